"""`zero_optimization.offload_param` / `offload_optimizer`: where ZeRO keeps parameters and
optimizer state. Defaults are DeepSpeed 0.19.8's (runtime/zero/offload_config.py).

`offload_optimizer.device: "nvme"` swaps the fp32 masters and optimizer states to files under
`nvme_path` (runtime/swap_tensor/, docs/offload.md), at ZeRO stages 1-3 (upstream: stage 3 only).
`offload_param.device: "nvme"` keeps ZeRO-3 parameter shards in files under `nvme_path`, at most
`max_in_cpu` elements of them in memory (runtime/swap_tensor/param_swapper.py); stage 3 only, as upstream.
"""

from __future__ import annotations

import os
from typing import Iterator, Literal, Optional

from pydantic import Field, field_validator

from .base import DSModel, Float, Int, Problem, not_supported

OffloadDevice = Literal["none", "cpu", "nvme"]


class _OffloadCommon(DSModel):
    device: OffloadDevice = "none"
    """Where to offload: "none", "cpu" or "nvme"."""
    nvme_path: Optional[str] = None
    """Filesystem path for NVMe offload (unused otherwise; null is fine)."""
    pin_memory: bool = True
    """Use page-locked CPU memory, needed for asynchronous full-bandwidth copies."""

    @field_validator("device", mode="before")
    @classmethod
    def _device_lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    def _nvme_path_problems(self) -> Iterator[Problem]:
        """`nvme_path` must name a writable directory when the device is nvme, or one that can be
        made (created at initialize, as upstream's swappers do): its nearest existing ancestor is a
        writable directory."""
        if self.device != "nvme":
            return
        if not self.nvme_path:
            yield "nvme_path", 'is required with device: "nvme": a directory on the fast local disk to swap to'
            return
        existing = os.path.abspath(self.nvme_path)
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            yield "nvme_path", f"{self.nvme_path!r} is not a directory and cannot be made one ({existing!r} is a file)"
        elif not os.access(existing, os.W_OK | os.X_OK):
            yield "nvme_path", f"{self.nvme_path!r} is not writable by this process ({existing!r})"


class OffloadParamConfig(_OffloadCommon):
    """Parameter offload; valid only with ZeRO stage 3."""

    def _problems(self) -> Iterator[Problem]:
        yield from self._nvme_path_problems()

    buffer_count: Int = Field(5, ge=0)
    """NVMe only: buffers in upstream's parameter swap pool (accepted; `max_in_cpu` bounds memory here)."""
    buffer_size: Int = Field(100_000_000, ge=0)
    """NVMe only: elements per upstream swap buffer (accepted; shards of any size are swapped here)."""
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    """NVMe only: at most this many elements of parameter shards in CPU memory (at least one unit's)."""


class OffloadOptimizerConfig(_OffloadCommon):
    """Optimizer-state offload (the optimizer step then runs on the CPU); ZeRO stages 1-3."""

    buffer_count: Int = Field(4, ge=0)
    """NVMe only: buffers in the optimizer-state swap pool."""
    pipeline_read: bool = False
    """NVMe only: overlap reading the next tile with the current tile's step."""
    pipeline_write: bool = False
    """NVMe only: overlap writing the previous tile with the current tile's step."""
    fast_init: bool = False
    """NVMe only: fast optimizer initialisation."""
    ratio: Float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer state offloaded (upstream: partial offload is stage 3 only)."""
    super_offload: bool = False
    """SuperOffload for Superchips (upstream: stage 3 only)."""
    cpuadam_cores_perc: Float = Field(0.8, ge=0.0, le=1.0)
    """SuperOffload only: share of CPU cores used by CPU Adam."""

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write

    def _problems(self) -> Iterator[Problem]:
        yield from self._nvme_path_problems()
        if self.ratio < 1.0:
            yield "ratio", not_supported(f"partial optimizer offload (ratio {self.ratio})", "set ratio to 1.0")
        if self.super_offload:
            yield "super_offload", not_supported("SuperOffload", "set super_offload: false")


# Upstream class names.
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
