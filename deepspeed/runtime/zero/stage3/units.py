"""Pure planning of ZeRO-3 gather units: which parameters are gathered together, and when.

A *gather unit* is the set of parameters fetched by ONE all-gather (and whose gradients are
reduced by ONE reduce-scatter). Per-tensor collectives would cost one launch per tensor (a
transformer block has ~10); per-unit collectives cost one per module, the granularity at which
hooks can tell that parameters are needed. The plan is a pure function of the module tree (no
process group, no tensors touched), so it is tested without processes and is the same on every
rank by construction, which is what keeps collectives matched across ranks.

[Note: unit ownership and tied parameters]
Modules are visited in `named_modules()` order. A module owns the parameters it holds directly
(`recurse=False`) that no earlier module owned; a module flagged as a ZeRO-3 leaf
(`z3_leaf_module`) owns every not-yet-owned parameter of its whole subtree, and its descendants
get no unit and no hooks (they run inside the leaf's gather; see utils/z3_leaf_module.py).
A parameter shared by two modules (tied embedding / output head) thus has exactly one owner
unit, so it has one shard and one gradient slot, and its two uses' gradients are summed by
autograd before they reach it. Every module records the units of *all* parameters it uses
(`module_units`), so running the second module gathers the first one's unit as well.

[Note: persistence]
A unit whose total numel is <= `persistence_threshold` is persistent: gathered once and never
released, trading a little memory for not issuing a tiny latency-bound collective per use
(upstream's `stage3_param_persistence_threshold`, which it applies per tensor; we apply it per
unit because the collective is per unit). `model_persistence_threshold` caps the persistent
total, units taken in plan order. Empty units (numel 0) are always persistent, so no
zero-sized collective is ever issued.

[Note: external parameters]
A module may read a parameter another module owns (an output head reusing `embed.weight`
without holding it). `register_external_parameter(module, p)` records that here, in
`_EXTERNAL`, the one registry; the plan adds the owner unit of `p` to that module's uses, so
its hooks gather it. Ownership ignores the registry (a unit's layout never depends on it), so
registering after initialize only changes which units a module gathers.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from torch import nn

from ....utils.z3_leaf_module import z3_leaf_module


@dataclass(frozen=True)
class UnitSpec:
    """One gather unit: its parameters in flattening order and whether it stays gathered."""

    index: int
    owner: str                     # module name from named_modules() ("" is the root)
    param_names: tuple[str, ...]   # the first name named_parameters() gives each parameter
    numels: tuple[int, ...]
    persistent: bool

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class UnitPlan:
    units: tuple[UnitSpec, ...]
    module_units: dict[str, tuple[int, ...]]   # hooked module name -> units it needs, in order
    param_unit: dict[str, int]                 # parameter name -> owning unit

    def gathers_per_call(self, module_name: str) -> int:
        """All-gathers one call of `module_name` issues when nothing is gathered yet."""
        return sum(not self.units[u].persistent for u in self.module_units.get(module_name, ()))


# module -> parameters it reads but another module owns, in registration order.
_EXTERNAL: "weakref.WeakKeyDictionary[nn.Module, dict[nn.Parameter, None]]" = weakref.WeakKeyDictionary()


def add_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    _EXTERNAL.setdefault(module, {})[param] = None
    param.is_external_param = True   # upstream's flag: some module reads it as an external parameter


def remove_external_parameter(module: nn.Module, param: nn.Parameter) -> bool:
    """False when `param` was not registered on `module`."""
    found = _EXTERNAL.get(module, {})
    removed = found.pop(param, False) is None
    if removed and not any(param in params for params in _EXTERNAL.values()):
        param.is_external_param = False
    return removed


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(_EXTERNAL.get(module, ()))


def _used_params(module: nn.Module, leaf: bool) -> list[nn.Parameter]:
    params = module.parameters() if leaf else module.parameters(recurse=False)
    return list(dict.fromkeys(p for p in params if p is not None))


def _external_params(module: nn.Module, leaf: bool) -> list[nn.Parameter]:
    modules = module.modules() if leaf else (module,)
    return [p for m in modules for p in external_parameters(m)]


def _inside_leaf(name: str, leaves: list[str]) -> bool:
    return any(name.startswith(leaf + ".") or (leaf == "" and name != "") for leaf in leaves)


def plan_units(model: nn.Module, persistence_threshold: int = 0, model_persistence_threshold: int = sys.maxsize,
               numel_of: Callable[[nn.Parameter], int] = torch.Tensor.numel,
               kind_of: Callable[[nn.Parameter], Hashable] | None = None) -> UnitPlan:
    """Plan the gather units of `model`. See [Note: unit ownership and tied parameters].
    `numel_of` gives a parameter's full size when `.data` is a placeholder (zero.Init, released).
    `kind_of`: parameters a module owns are split into one unit per kind, in order of first
    appearance (expert parameters are partitioned over another group: [Note: ZeRO-3 expert units]
    in coordinator.py); default: one kind."""
    param_name = {}
    for name, p in model.named_parameters():
        param_name.setdefault(p, name)
    owned: dict[nn.Parameter, int] = {}
    raw: list[tuple[str, list[nn.Parameter]]] = []
    uses: dict[str, list[nn.Parameter]] = {}
    leaves: list[str] = []
    for name, module in model.named_modules():
        if _inside_leaf(name, leaves):
            continue
        leaf = z3_leaf_module(module)
        if leaf:
            leaves.append(name)
        used = _used_params(module, leaf)
        if used or _external_params(module, leaf):
            uses[name] = list(dict.fromkeys(used + _external_params(module, leaf)))
        mine = [p for p in used if p not in owned]
        by_kind: dict[Hashable, list[nn.Parameter]] = {}
        for p in mine:
            by_kind.setdefault(kind_of(p) if kind_of is not None else None, []).append(p)
        for params in by_kind.values():
            for p in params:
                owned[p] = len(raw)
            raw.append((name, params))
    units, persistent_total = [], 0
    for index, (owner, params) in enumerate(raw):
        numels = tuple(numel_of(p) for p in params)
        numel = sum(numels)
        persistent = numel == 0 or (numel <= persistence_threshold
                                    and persistent_total + numel <= model_persistence_threshold)
        persistent_total += numel if persistent else 0
        units.append(UnitSpec(index, owner, tuple(param_name[p] for p in params),
                              numels, persistent))
    strangers = [name for name, used in uses.items() for p in used if p not in owned]
    if strangers:
        raise ValueError(f"ZeRO-3: modules {sorted(set(strangers))} have an external parameter that is not a "
                         f"parameter of the model; register only parameters some module of the model holds")
    module_units = {name: tuple(dict.fromkeys(owned[p] for p in used)) for name, used in uses.items()}
    param_unit = {param_name[p]: u for p, u in owned.items()}
    return UnitPlan(tuple(units), module_units, param_unit)
