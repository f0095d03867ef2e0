# compat: upstream path deepspeed.runtime.utils (DeepSpeed 0.19.8 names).
"""Upstream's grab-bag of runtime helpers, under their names. The partitioning functions live
in layer_partition.py, PartitionedTensor in partitioned_tensor.py, move_to_device in dataloader.py,
see_memory_usage in memory_report.py;
the rest of upstream's module (MoE-aware clipping/overflow checks, ZeRO-3 output hooks) is not
provided: see docs/compatibility.md."""

from __future__ import annotations

from typing import Any

import torch

from .dataloader import move_to_device  # noqa: F401
from .layer_partition import partition_balanced, partition_uniform, prefix_sum_inc  # noqa: F401
from .memory_report import see_memory_usage  # noqa: F401
from .partitioned_tensor import PartitionedTensor  # noqa: F401


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(arg, ..., key=value)` with reprs of the arguments, e.g. for layer specs in logs."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether `p` is split across tensor-parallel ranks (marked by Megatron-style trainers with
    `tensor_model_parallel` / `model_parallel`, or DeepSpeed's `ds_tensor_model_parallel`)."""
    return any(bool(getattr(p, attr, False)) for attr in ("ds_tensor_model_parallel", "tensor_model_parallel",
                                                          "model_parallel"))
