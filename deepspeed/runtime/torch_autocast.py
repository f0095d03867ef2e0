"""`torch_autocast` support: which parameters may be communicated in the autocast dtype.

Under `torch_autocast` parameters stay fp32 and torch.autocast picks per-op precision. Parameters of
"lower precision safe" modules (default: exactly nn.Linear / Conv1d / Conv2d / Conv3d, matched by
exact class as upstream does, not by isinstance) have their gradients reduced -- and, with ZeRO-3,
their weights all-gathered -- in the autocast dtype; all other parameters use their own dtype.

One owner: the module-level `AUTOCAST_PARAMS` registry (an `AutocastParams`) records the marked
parameters by identity. Upstream kept this as module globals plus `param.comm_dtype`; the public
functions keep upstream's names and signatures (DeepSpeed 0.19.8), and the registry publishes
`comm_dtype` on marked parameters in `_publish_compat_attrs` only because upstream tests read it.
Internal code asks the functions below, never the attribute.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Set, Union

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import log_dist

LOWER_PRECISION_SAFE_MODULES = [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
CONFIG_KEY = "torch_autocast.lower_precision_safe_modules"


class AutocastParams:
    """Sole owner of torch_autocast parameter state: param -> comm dtype, plus the autocast dtype."""

    def __init__(self) -> None:
        self._comm_dtype: WeakIdKeyDictionary = WeakIdKeyDictionary()  # identity keys; no param is kept alive
        self.dtype: Optional[torch.dtype] = None
        self.initialized = False

    def mark(self, model: nn.Module, dtype: torch.dtype, safe_classes: Sequence[type]) -> int:
        """Record the direct parameters of every module whose exact class is safe; return how many."""
        safe = tuple(safe_classes)
        count = 0
        for module in model.modules():
            if type(module) in safe:
                for param in module.parameters(recurse=False):
                    self._comm_dtype[param] = dtype
                    _publish_compat_attrs(param, dtype)
                    count += 1
        self.dtype, self.initialized = dtype, True
        return count

    def comm_dtype(self, param: torch.Tensor) -> Optional[torch.dtype]:
        return self._comm_dtype.get(param)

    def reset(self) -> None:
        """Forget everything (tests; a fresh process has nothing to forget)."""
        self._comm_dtype = WeakIdKeyDictionary()
        self.dtype, self.initialized = None, False


AUTOCAST_PARAMS = AutocastParams()


def _publish_compat_attrs(param: torch.Tensor, dtype: torch.dtype) -> None:
    """The only writer of upstream's `param.comm_dtype`, kept for code that probes it with hasattr."""
    setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, dtype)


def resolve_module_classes(names: Optional[Iterable[Union[str, type]]]) -> List[type]:
    """Dotted class names ("torch.nn.Linear") -> classes; None -> the default list.

    A name that does not import, or does not name an nn.Module class, is a config error.
    """
    if names is None:
        return list(LOWER_PRECISION_SAFE_MODULES)
    classes = []
    for name in names:
        cls = name if isinstance(name, type) else _import_class(name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{CONFIG_KEY}: {name!r} is not an nn.Module class; give dotted class names such as "
                             "\"torch.nn.Linear\"")
        classes.append(cls)
    return classes


def _import_class(name: Any) -> Any:
    module_name, _, attr = name.rpartition(".") if isinstance(name, str) else ("", "", "")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{CONFIG_KEY}: cannot import {name!r} ({err}); give dotted class names such as "
                         "\"torch.nn.Linear\"") from err


def init_autocast_params(engine: Any, dtype: torch.dtype,
                         torch_autocast_lower_precision_safe_modules: Optional[List[str]] = None) -> None:
    """Mark the parameters of lower-precision-safe modules (upstream signature).

    `engine` is a DeepSpeed engine or any nn.Module (an engine is one, and its `module` is inside it).
    `dtype=None` (config without `dtype`) means torch.autocast's default for the device; upstream
    stored None as the comm dtype there, which no collective accepts.
    """
    quantized = getattr(engine, "zero_quantized_weights", None)
    if callable(quantized) and quantized():
        raise ValueError("torch_autocast.enabled cannot be combined with zero_optimization.zero_quantized_weights")
    model = engine if isinstance(engine, nn.Module) else engine.module
    classes = resolve_module_classes(torch_autocast_lower_precision_safe_modules)
    if dtype is None:
        dtype = torch.get_autocast_dtype(get_accelerator().device_name())
    AUTOCAST_PARAMS.mark(model, dtype, classes)


def is_autocast_initialized() -> bool:
    return AUTOCAST_PARAMS.initialized


def get_default_autocast_lower_precision_modules() -> List[str]:
    """Upstream's form: the defining module's path, e.g. "torch.nn.modules.linear.Linear"."""
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def get_autocast_dtype(param: Optional[torch.Tensor] = None) -> Optional[torch.dtype]:
    """The autocast dtype of the last init (upstream: no argument); given a param, its autocast
    dtype, or None when it is not lower precision safe."""
    return AUTOCAST_PARAMS.dtype if param is None else AUTOCAST_PARAMS.comm_dtype(param)


def has_comm_dtype(param: torch.Tensor) -> bool:
    return AUTOCAST_PARAMS.comm_dtype(param) is not None


has_autocast_dtype = has_comm_dtype  # the name upstream's docs (autofunction) give


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype to reduce this param's gradient (and all-gather it, ZeRO-3) in: the autocast dtype
    for lower-precision-safe params, else the param's own dtype."""
    dtype = AUTOCAST_PARAMS.comm_dtype(param)
    return param.dtype if dtype is None else dtype


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> Set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> List[torch.dtype]:
    """A rank-independent order, so every rank reduces the per-dtype buckets in the same order."""
    return sorted(dtypes, key=str)


_warned_nested = False


@contextmanager
def autocast_if_enabled(engine: Any) -> Iterator[None]:
    """Run forward under the engine's `torch_autocast` setting, overriding an outer torch.autocast.

    An outer autocast with the engine's autocast off is disabled inside: bf16/fp16 engines cast
    the model themselves, and their config, not the caller's context, decides the precision.
    """
    global _warned_nested
    device_type = get_accelerator().device_name()
    enabled = bool(engine.torch_autocast_enabled())
    if torch.is_autocast_enabled(device_type) and not _warned_nested:
        _warned_nested = True
        log_dist("torch.autocast is active outside DeepSpeed; the engine's `torch_autocast` section decides "
                 f"inside it (enabled={enabled}).", ranks=[0])
    if enabled:
        with torch.autocast(device_type=device_type, dtype=engine.torch_autocast_dtype(), enabled=True):
            yield
    elif torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
