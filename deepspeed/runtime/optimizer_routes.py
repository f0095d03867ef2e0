"""Upstream's optimizer-wrapper class names as isinstance checks on our wrappers.

DeepSpeed 0.19.8 builds a different wrapper class for each precision route (BF16_Optimizer,
FP16_Optimizer, FP16_UnfusedOptimizer, ...); our engine builds the same numerics from its general
wrappers (MixedPrecisionOptimizer, ZeroOptimizer) and marks each with the route upstream would have
taken (engine_setup.wrap_optimizer). `isinstance(engine.optimizer, FP16_Optimizer)` is then true
exactly where upstream's engine would have built one. The classes cannot be constructed directly.
"""

from __future__ import annotations

from typing import Any


class RouteCheck(type):
    """Metaclass: an object is an instance when its `optimizer_route` names this class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return getattr(obj, "optimizer_route", None) == cls.__name__ or type.__instancecheck__(cls, obj)


class RouteClass(metaclass=RouteCheck):
    """Base of the route classes; see the module docstring."""

    built_when = "by deepspeed.initialize"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} is built {cls.built_when}; it has no public constructor")
