"""Automatic external parameters: a released ZeRO-3 parameter read during a forward is gathered
on the spot and registered on the module that read it.

[Note: automatic external parameters]
A module's hooks gather the units of the parameters it holds (and those registered with
`register_external_parameter`). A forward that reads a parameter held by *another* module --
`F.linear(h, self.embed.weight)` for a tied output head written functionally -- would find the
released placeholder (0 elements) and fail with a shape error. While the root module's forward
runs, the coordinator activates `ExternalUseDetector`, a TorchFunctionMode that looks at the
tensor arguments of every torch function call: a parameter whose unit is released is reported
to the coordinator, which gathers the unit at once (a collective: every rank runs the same code
and reaches the same call), keeps it until the innermost running module's forward ends (held
for that module's backward like its own units) and registers the parameter as an external
parameter of that module, re-planning at the end of the forward. From the next forward the
module's pre-hook gathers it with its own units, so the detector fires once per parameter.
Upstream only registers a parameter automatically when a module *returns* it; this covers any
read. Metadata reads (`.shape`, `.dtype`, `.size()`, `.numel()`, ...) are not uses: a released
parameter reports 0 elements there, as upstream's do (`ds_shape` has the real shape).
Cost: one Python call per torch function during forwards (measured in BENCHMARKS.md); set
DEEPSPEED_ZERO3_AUTO_EXTERNAL=0 to turn the detector off. Reads outside any forward of the
root module (calling a submodule directly) are not seen: register those parameters.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

ENV = "DEEPSPEED_ZERO3_AUTO_EXTERNAL"

# Calls that read metadata, not values: a released parameter may be asked these freely.
_METADATA = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "ndimension", "numel", "nelement", "element_size",
    "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device",
    "data_ptr", "untyped_storage", "__hash__", "__repr__", "__format__", "__len__", "__bool__", "type",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad",
})


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off")


class ExternalUseDetector(TorchFunctionMode):
    """Calls `on_use(param)` for every parameter argument that `is_released(param)` says is
    released, before the torch function runs (see [Note: automatic external parameters])."""

    def __init__(self, is_released: Callable[[nn.Parameter], bool], on_use: Callable[[nn.Parameter], None]) -> None:
        super().__init__()
        self.is_released, self.on_use = is_released, on_use

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for value in (*args, *kwargs.values()):
                if isinstance(value, nn.Parameter):
                    if self.is_released(value):
                        self.on_use(value)
                elif isinstance(value, (list, tuple)):   # torch.cat([...]), torch.stack(...)
                    for item in value:
                        if isinstance(item, nn.Parameter) and self.is_released(item):
                            self.on_use(item)
        return func(*args, **kwargs)

