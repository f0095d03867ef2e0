"""Automatic external parameters: a released ZeRO-3 parameter read during a forward is gathered
on the spot and registered on the module that read it.

[Note: automatic external parameters]
A module's hooks gather the units of the parameters it holds (and those registered with
`register_external_parameter`). A forward that reads a parameter held by *another* module --
`F.linear(h, self.embed.weight)` for a tied output head written functionally -- would find the
released placeholder (0 elements) and fail with a shape error. While the root module's forward
runs, the coordinator activates `ExternalUseDetector`, a TorchFunctionMode that looks at the
tensor arguments of every torch function call: a parameter that no running module holds is
reported to the coordinator, which gathers its unit at once if it is released (a collective:
every rank runs the same code and reaches the same call), keeps it until the innermost running
module's forward ends (held for that module's backward like its own units) and registers the
parameter as an external parameter of that module, re-planning at the end of the forward. From
the next forward the module's pre-hook gathers it with its own units, so the detector fires once
per parameter.
"Held by no running module" is the test, not "released": a parameter that someone else made
whole for the moment -- a `GatheredParameters` block around the read (TRL's fused LM-head loss
reads `lm_head.weight` that way, inside the model's forward, and hands it to a custom
`autograd.Function`), a unit kept from an earlier module's forward -- is released again before
the backward that needs it; registered, the reading module's backward hook gathers and holds it
(upstream registers such a parameter when the module attribute is read while released).
Two exceptions raise instead: a read of a released parameter inside a z3 leaf module (routing
there may differ by rank, so the gather could happen on some ranks only: register the parameter
on the leaf; a parameter someone else gathered is left alone there), and an in-place write to a
released parameter (lost at the next release: use GatheredParameters with a modifier_rank).
Upstream only registers a parameter automatically when a module *returns* it or reads the
attribute while released; this covers any value read. Metadata reads (`.shape`, `.dtype`,
`.size()`, `.numel()`, `.new_zeros()`, ...) are not uses: a released parameter reports 0
elements there, as upstream's do (`ds_shape` has the real shape); value reads through properties
(`.T`, `.mT`, `.data`) are. Arguments are scanned one level deep (tensors, and lists or tuples of
them). A parameter passed to `autograd.Function.apply` is seen by the first torch function its
`forward` calls on it (apply itself is no torch function); the gradient that backward returns for
it is then checked against the parameter's full shape, see [Note: gradients for released
parameters] in coordinator.py.
Cost: one Python call per torch function during forwards (measured in BENCHMARKS.md); set
DEEPSPEED_ZERO3_AUTO_EXTERNAL=0 to turn the detector off. Reads outside any forward of the
root module (calling a submodule directly) are not seen: register those parameters.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from torch import nn
from torch.overrides import TorchFunctionMode

ENV = "DEEPSPEED_ZERO3_AUTO_EXTERNAL"

# Calls that read metadata, not values: a released parameter may be asked these freely.
_METADATA = frozenset({
    "__set__", "__delete__", "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
    "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device", "data_ptr",
    "untyped_storage", "__hash__", "__repr__", "__format__", "__len__", "__bool__", "type", "register_hook",
    "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad", "is_pinned", "is_shared",
    "is_inference", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
})
# Properties (`Tensor.<name>.__get__`) that are metadata; the others (`.T`, `.mT`, `.data`,
# `.real`, ...) read the values and count as uses.
_METADATA_PROPERTIES = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "_grad", "is_leaf", "ndim", "layout", "is_cuda",
    "is_cpu", "is_xpu", "is_mps", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names",
    "grad_fn", "_grad_fn", "_version", "output_nr", "itemsize", "nbytes", "retains_grad", "name",
    "_backward_hooks", "_post_accumulate_grad_hooks", "_base", "_cdata", "is_sparse_csr",
})
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__ifloordiv__"})


def is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    return name in _METADATA


def is_in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off")


class ExternalUseDetector(TorchFunctionMode):
    """Calls `on_use(param)` for every parameter argument that `unheld(param)` says no running
    module holds, before the torch function runs (see [Note: automatic external parameters]);
    an in-place write to a parameter that `is_released(param)` raises."""

    def __init__(self, is_released: Callable[[nn.Parameter], bool], unheld: Callable[[nn.Parameter], bool],
                 on_use: Callable[[nn.Parameter], None]) -> None:
        super().__init__()
        self.is_released, self.unheld, self.on_use = is_released, unheld, on_use

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_metadata(func):
            read = args
            if args and isinstance(args[0], nn.Parameter) and is_in_place(func):
                if self.is_released(args[0]):
                    raise RuntimeError(f"ZeRO-3: an in-place write ({getattr(func, '__name__', func)}) to a released "
                                       f"parameter would be lost when it is released again; write inside "
                                       f"deepspeed.zero.GatheredParameters(params, modifier_rank=0)")
                read = args[1:]   # written where someone gathered it (GatheredParameters): not a read
            for value in (*read, *kwargs.values()):
                if isinstance(value, nn.Parameter):
                    if self.unheld(value):
                        self.on_use(value)
                elif isinstance(value, (list, tuple)):   # torch.cat([...]), torch.stack(...)
                    for item in value:
                        if isinstance(item, nn.Parameter) and self.unheld(item):
                            self.on_use(item)
        return func(*args, **kwargs)

