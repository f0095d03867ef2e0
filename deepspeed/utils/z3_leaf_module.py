"""ZeRO-3 leaf modules: modules whose whole subtree is gathered as one unit, with no hooks inside.

Data-dependent routing (MoE experts) runs a different set of submodules on every rank; ZeRO-3
hooks per submodule would then issue different collectives on different ranks and hang. A leaf
module's descendants are gathered together when the leaf starts, so every rank does the same.
The flag is an attribute on the module (`_z3_leaf`, upstream's name, which Hugging Face reads);
its parameters carry `ds_z3_leaf_module`. Classes match by `isinstance`, by fully qualified name
or by bare class name, so configs can name Hugging Face classes without importing them.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

import torch

from .logging import logger

__all__ = ["z3_leaf_module", "z3_leaf_parameter", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "apply_zero_leaf_module_config"]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when `model` is flagged as a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """True when `param` belongs to a leaf module's subtree."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag
    for p in model.parameters():
        if flag:
            p.ds_z3_leaf_module = model
        elif hasattr(p, "ds_z3_leaf_module"):
            del p.ds_z3_leaf_module


def _matches(module: torch.nn.Module, spec: Any) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    # a dotted name also matches by its last component, so that the default list's Hugging Face
    # classes are recognised without importing transformers (and in vendored copies of them)
    return spec in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__) or spec.rsplit(".", 1)[-1] == cls.__name__


def _flag(modules: Iterable[torch.nn.Module], flag: bool) -> List[torch.nn.Module]:
    found = list(dict.fromkeys(modules))
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def _by_class(model: torch.nn.Module, classes: list, flag: bool, raise_if_not_found: bool) -> List[torch.nn.Module]:
    if not isinstance(classes, (list, tuple)):
        raise TypeError(f"leaf module classes must be a list of classes or class names, got {type(classes).__name__}")
    found = _flag((m for m in model.modules() if any(_matches(m, c) for c in classes)), flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(classes)} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Flag every module whose class is (a subclass of) one of `leaf_module_classes`
    (classes, dotted names or bare names). Returns the flagged modules."""
    return _by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    return _by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list, flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag the modules named exactly as in `model.named_modules()`. Returns (modules, missing names)."""
    named = dict(model.named_modules())
    missing = [n for n in module_names if n not in named]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return _flag((named[n] for n in module_names if n in named), flag), missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list, flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Flag the modules whose `named_modules()` path ends with one of the suffixes."""
    named = list(model.named_modules())
    hits = {s: [m for n, m in named if n == s or n.endswith("." + s) or (s.startswith(".") and n.endswith(s))]
            for s in module_name_suffixes}
    missing = [s for s, ms in hits.items() if not ms]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    return _flag((m for ms in hits.values() for m in ms), flag), missing


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_cfg: Any) -> List[torch.nn.Module]:
    """Flag the modules named by a `zero_optimization.leaf_module` config section (no errors:
    unmatched names are warned about, as the default class list rarely matches)."""
    if leaf_cfg is None:
        return []
    found = set_z3_leaf_modules(model, list(leaf_cfg.classes), raise_if_not_found=False)
    by_name, missing_names = set_z3_leaf_modules_by_name(model, list(leaf_cfg.names), raise_if_not_found=False)
    by_suffix, missing_suffixes = set_z3_leaf_modules_by_suffix(model, list(leaf_cfg.name_suffixes),
                                                                raise_if_not_found=False)
    if missing_names:
        logger.warning(f"zero_optimization.leaf_module.names: no modules named {missing_names}")
    if missing_suffixes:
        logger.warning(f"zero_optimization.leaf_module.name_suffixes: no modules ending with {missing_suffixes}")
    return list(dict.fromkeys(found + by_name + by_suffix))
