"""Small sections: `timers`, `aio`."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import DSModel, Int


class ThroughputTimerConfig(DSModel):
    """`timers.throughput`."""

    enabled: bool = True
    """Measure samples per second."""
    synchronized: bool = True
    """Synchronise the device before reading the clock (exact, slower)."""


class TimersConfig(DSModel):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer."""


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
