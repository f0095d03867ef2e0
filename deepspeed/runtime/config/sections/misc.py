"""Small sections: `timers`, `flops_profiler`, `aio`."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import DSModel, Float, Int


class ThroughputTimerConfig(DSModel):
    """`timers.throughput`."""

    enabled: bool = True
    """Measure samples per second."""
    synchronized: bool = True
    """Time the device's work, not the host's: with an asynchronous device (CUDA) each step is
    timed with device events read at each report, so this never stalls the device (upstream
    synchronizes it at every start and stop). False: the host clock."""


class TimersConfig(DSModel):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer."""


class FlopsProfilerConfig(DSModel):
    """`flops_profiler`: profile one training step (deepspeed.profiling.flops_profiler)."""

    enabled: bool = False
    """Profile the FLOPs, parameters and latency of each module once, on rank 0."""
    recompute_fwd_factor: Float = Field(0.0, ge=0)
    """Share of the forward recomputed in backward (activation checkpointing), for the estimate
    of backward FLOPs as (2 + factor) x forward; the engine also reports the measured ones."""
    profile_step: Int = Field(1, ge=0)
    """Optimizer step whose first forward is counted (the next step's forward is timed)."""
    module_depth: Int = Field(-1, ge=-1)
    """Depth of the aggregated per-module report (-1: all depths)."""
    top_modules: Int = Field(1, ge=1)
    """Module types listed per depth in the aggregated report."""
    detailed: bool = True
    """Print the whole module tree with each module's profile."""
    output_file: Optional[str] = None
    """Write the report to this file instead of stdout."""


class AioConfig(DSModel):
    """`aio`: async-I/O knobs of NVMe offload. Parsed for compatibility; NVMe offload itself is
    rejected (see offload.py), so these values have no effect here."""

    block_size: Int = Field(1_048_576, gt=0)
    """Bytes per I/O request."""
    queue_depth: Int = Field(8, gt=0)
    """I/O queue depth."""
    intra_op_parallelism: Int = Field(1, gt=0)
    """Threads per I/O operation."""
    single_submit: bool = False
    """Submit requests one at a time."""
    overlap_events: bool = True
    """Overlap submission and completion."""
    use_gds: bool = False
    """Use GPUDirect Storage."""
    thread_count: Optional[Int] = Field(None, gt=0)
    """Pre-0.15 name of `intra_op_parallelism`. DeepSpeed 0.19.8 reads the aio section key by key
    and ignores this one; Lightning's DeepSpeedStrategy still writes it. Accepted and ignored."""
