"""deepspeed.zero.GatheredParameters and register/unregister_external_parameter.

GatheredParameters makes ZeRO-3 parameters whole inside a block, wherever they are in their
life: partitioned by zero.Init before initialize (init_context.acquire/release, one all-gather
per parameter) or owned by a gather unit after it (ShardedUnit.acquire/release, one all-gather
per unit). With `modifier_rank`, what that rank holds at the end of the block is broadcast and
re-partitioned into every rank's slice; for a unit, `ShardedUnit.scatter_from` rewrites the
shard and tells its listeners which elements changed, so Stage3Optimizer refreshes exactly
those elements of its fp32 master (the optimizer registers the listener; nothing here reaches
into it). It is a collective: every rank enters it with the same parameters in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import init_context
from .coordinator import external_parameters_changed
from .sharded_param import ShardedUnit, unit_of
from .units import add_external_parameter, remove_external_parameter


def _as_list(params: Any) -> list[Any]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(dict.fromkeys(params))


class GatheredParameters:
    """Gather `params` (a parameter or an iterable of them) for the duration of the block.

    `modifier_rank`: the group rank whose values are kept when the block ends (None: read-only
    use, changes are dropped). `fwd_module`: the parameters are also registered as external
    parameters of that module (upstream's meaning). Parameters not partitioned by ZeRO-3 pass
    through untouched; `enabled=False` makes the block a no-op.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._units: list[ShardedUnit] = []
        self._init_params: list[nn.Parameter] = []
        if fwd_module is not None:
            for p in self.params:
                if unit_of(p) is not None or init_context.init_shard(p) is not None:
                    register_external_parameter(fwd_module, p)

    def __enter__(self) -> "GatheredParameters":
        self._units = list(dict.fromkeys(u for u in map(unit_of, self.params) if u is not None))
        self._init_params = [p for p in self.params if init_context.init_shard(p) is not None]
        for unit in self._units:
            unit.acquire(exact=True)
        for p in self._init_params:
            init_context.acquire(p)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # After an exception the broadcast is skipped (the other ranks raised too, or the
        # collective could not match anyway); the parameters are released all the same.
        src = self.modifier_rank if exc_type is None else None
        for p in self._init_params:
            init_context.release(p, src)
        for unit in reversed(self._units):
            try:
                if src is not None:
                    unit.scatter_from(src)
            finally:
                unit.release(keep_aliases=True)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """`module`'s forward reads `parameter`, which another module holds: gather it with
    `module`'s units (before or after deepspeed.initialize). See [Note: external parameters]."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("register_external_parameter: parameter is not a torch.nn.Parameter")
    add_external_parameter(module, parameter)
    external_parameters_changed(module)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("unregister_external_parameter: parameter is not a torch.nn.Parameter")
    if not remove_external_parameter(module, parameter):
        raise RuntimeError("unregister_external_parameter: parameter is not a registered external parameter "
                           "of module")
    external_parameters_changed(module)


__all__ = ["GatheredParameters", "register_external_parameter", "unregister_external_parameter"]
