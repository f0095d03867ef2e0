"""Small sections: `timers`, `flops_profiler`, `aio`."""

from __future__ import annotations

from typing import Iterator, Optional

from pydantic import Field

from .base import DSModel, Float, Int, Problem, not_supported


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
    """`aio`: the I/O handle NVMe offload swaps through (deepspeed/ops/aio/handle.py); tune it with
    `ds_nvme_tune` (docs/offload.md)."""

    block_size: Int = Field(1_048_576, gt=0)
    """Bytes per I/O request."""
    queue_depth: Int = Field(8, gt=0)
    """I/O queue depth."""
    intra_op_parallelism: Int = Field(1, gt=0)
    """Threads per I/O operation: each request is cut into this many parallel chunks."""
    single_submit: bool = False
    """Submit requests one at a time."""
    overlap_events: bool = True
    """Overlap submission and completion."""
    use_gds: bool = False
    """Use GPUDirect Storage. Not available in this build: true is an error naming the key."""
    thread_count: Optional[Int] = Field(None, gt=0)
    """Pre-0.15 name of `intra_op_parallelism` (Lightning's DeepSpeedStrategy still writes it).
    DeepSpeed 0.19.8 ignores it; here it is used when `intra_op_parallelism` is not given."""

    @property
    def threads(self) -> int:
        """The handle's intra_op_parallelism: the explicit key, else `thread_count`, else 1."""
        if "intra_op_parallelism" in self.model_fields_set or self.thread_count is None:
            return self.intra_op_parallelism
        return self.thread_count

    def handle_args(self) -> tuple[int, int, bool, bool, int]:
        """The arguments of `aio_handle(...)`, in upstream's order."""
        return self.block_size, self.queue_depth, self.single_submit, self.overlap_events, self.threads

    def _problems(self) -> Iterator[Problem]:
        if self.use_gds:
            yield "use_gds", not_supported("GPUDirect Storage (use_gds: true): this build has no GDS; NVMe "
                                           "offload reads and writes through host memory", "set use_gds: false")
