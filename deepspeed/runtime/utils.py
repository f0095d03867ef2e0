# compat: upstream path deepspeed.runtime.utils (DeepSpeed 0.19.8 names).
"""Upstream's grab-bag of runtime helpers, under their names. The partitioning functions live
in layer_partition.py, PartitionedTensor in partitioned_tensor.py, move_to_device in dataloader.py;
the rest of upstream's module (MoE-aware clipping/overflow checks, ZeRO-3 output hooks) is not
provided: see docs/compatibility.md."""

from __future__ import annotations

import gc
from typing import Any

import torch

from ..utils.logging import log_dist
from .dataloader import move_to_device  # noqa: F401
from .layer_partition import partition_balanced, partition_uniform, prefix_sum_inc  # noqa: F401
from .partitioned_tensor import PartitionedTensor  # noqa: F401


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory on rank 0, only when `force` (upstream's switch; the
    `memory_breakdown` config turns it on in upstream's engine)."""
    if not force:
        return
    import psutil

    from ..accelerator import get_accelerator

    gc.collect()
    acc, gib = get_accelerator(), 2**30
    vm = psutil.virtual_memory()
    log_dist(f"{message} | MA {acc.memory_allocated() / gib:.2f} GB | Max_MA {acc.max_memory_allocated() / gib:.2f} GB"
             f" | CPU Virtual Memory: used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%",
             ranks=[0])
    acc.reset_peak_memory_stats()


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(arg, ..., key=value)` with reprs of the arguments, e.g. for layer specs in logs."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether `p` is split across tensor-parallel ranks (marked by Megatron-style trainers with
    `tensor_model_parallel` / `model_parallel`, or DeepSpeed's `ds_tensor_model_parallel`)."""
    return any(bool(getattr(p, attr, False)) for attr in ("ds_tensor_model_parallel", "tensor_model_parallel",
                                                          "model_parallel"))
