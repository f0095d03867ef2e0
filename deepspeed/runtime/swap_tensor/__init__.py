"""NVMe offload (ZeRO-Infinity): the run's swap directory (swap_files.py) and the optimizer-state
swapper (optimizer_swapper.py), both over the DeepNVMe handle (deepspeed/ops/aio). Upstream swaps no
tensor under `MIN_SWAPPABLE_BYTES`; this build swaps every size (the constant is kept for callers)."""

from __future__ import annotations

from typing import Any

MIN_SWAPPABLE_BYTES = 1024 * 1024  # upstream swaps no tensor smaller than 1 MiB


def attach_optimizer_swapper(wrapper: Any, config: Any, global_rank: int) -> Any:
    """Put a ZeRO optimizer's masters and state on NVMe (`offload_optimizer.device: "nvme"`)."""
    from ..errors import NotSupportedYet
    from .optimizer_swapper import OptimizerStateSwapper

    if wrapper.muon is not None:
        raise NotSupportedYet('the Muon optimizer with zero_optimization.offload_optimizer.device "nvme": not '
                              'supported in this build; use offload_optimizer.device "cpu"')
    shards = wrapper.units if hasattr(wrapper, "units") else wrapper.buckets
    offload = config.zero_optimization.offload_optimizer
    wrapper.swapper = OptimizerStateSwapper(wrapper, shards, config.aio, offload.nvme_path, global_rank,
                                            offload.buffer_count)
    return wrapper.swapper


__all__ = ["MIN_SWAPPABLE_BYTES", "attach_optimizer_swapper"]
