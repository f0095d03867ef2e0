"""Tensor-constructor wrappers installed while a zero.Init context is active.

Inside the context, `torch.tensor`, `empty`, `zeros`, `ones`, `full` and `arange` create their
tensors on the compute device when no device is given (as upstream). Upstream also casts every
floating result to Init's dtype; Init here passes `target_fp_dtype=None` instead and casts
parameters when it partitions them, so a model built under Init(bf16) holds exactly the values
of one built in fp32 and cast (weights are initialised in fp32, then rounded once), and buffers
keep their dtype until deepspeed.initialize applies the precision policy. The factory still
casts when given a dtype (callers other than Init may rely on upstream's meaning).

[Note: patchable constructor wrapper]
Hugging Face transformers replaces `deepspeed.runtime.zero.partition_parameters.
zero_wrapper_for_fp_tensor_constructor` (around zero.Init) to keep `torch.arange` out of the
dtype cast: its replacement recognises arange by identity (`fn is pp._orig_torch_arange`) and
reads the device from the `target_device=` keyword. So `install` looks the wrapper factory up in
that module's globals *at install time* (through sys.modules: the compat module sits above this
one and is never imported from here), calls it with `target_device=` as a keyword, and passes
exactly `ORIGINALS["arange"]`, the object published there as `_orig_torch_arange`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange")
ORIGINALS: dict[str, Callable] = {name: getattr(torch, name) for name in CONSTRUCTORS}
COMPAT_MODULE = "deepspeed.runtime.zero.partition_parameters"


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: Any = None) -> Callable:
    """`fn` wrapped: `device` defaults to `target_device`; floating results are cast to
    `target_fp_dtype` (None: left as created)."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def _factory() -> Callable:
    compat = sys.modules.get(COMPAT_MODULE)
    return getattr(compat, "zero_wrapper_for_fp_tensor_constructor", zero_wrapper_for_fp_tensor_constructor) \
        if compat is not None else zero_wrapper_for_fp_tensor_constructor


def install(target_fp_dtype: torch.dtype | None, target_device: torch.device) -> None:
    """Replace the torch constructors by wrapped ones (see [Note: patchable constructor wrapper])."""
    factory = _factory()
    for name in CONSTRUCTORS:
        setattr(torch, name, factory(ORIGINALS[name], target_fp_dtype, target_device=target_device))


def uninstall() -> None:
    for name, fn in ORIGINALS.items():
        setattr(torch, name, fn)
