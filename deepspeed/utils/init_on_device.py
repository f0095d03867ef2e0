"""OnDevice: build a module's tensors directly on a device (e.g. "meta") and in a dtype.

    with deepspeed.OnDevice(dtype=torch.half, device="meta"):
        model = MyModel()          # parameters are fp16 meta tensors: no memory, no init cost

Inside the block, `torch.empty/zeros/ones/full/tensor` (what nn.Module constructors call) create
their tensors on `device` when the call names no device, and floating results are cast to
`dtype` (None keeps them). Blocks nest, with each other and with zero.Init: each restores the
constructors it found.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_CONSTRUCTORS = ("empty", "zeros", "ones", "full", "tensor")


class OnDevice:
    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved: dict[str, Callable] = {}

    def _wrap(self, fn: Callable) -> Callable:
        def on_device(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("device") is None:
                kwargs["device"] = self.device
            tensor = fn(*args, **kwargs)
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            return tensor

        return on_device

    def __enter__(self) -> "OnDevice":
        if self.enabled:
            self._saved = {name: getattr(torch, name) for name in _CONSTRUCTORS}
            for name, fn in self._saved.items():
                setattr(torch, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch, name, fn)
        self._saved = {}
