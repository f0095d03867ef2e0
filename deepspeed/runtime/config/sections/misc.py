"""Small sections: `timers`, `aio`."""

from __future__ import annotations

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
