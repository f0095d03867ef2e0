# compat: upstream path deepspeed.runtime.bf16_optimizer (DeepSpeed 0.19.8 name).
"""`BF16_Optimizer`: upstream's optimizer wrapper for bf16 parameters with fp32 master weights and
fp32 gradient accumulation, which its engine builds without ZeRO (bf16 defaults to fp32
accumulation there) and at ZeRO stage 1 when `data_types.grad_accum_dtype` is "fp32" and the
optimizer is not offloaded.

Our engine builds the same numerics from its general wrappers (MixedPrecisionOptimizer without
ZeRO, ZeroOptimizer at stage 1, both with fp32 masters and fp32 gradient buckets), so this is not
a separate class: `isinstance(engine.optimizer, BF16_Optimizer)` is true exactly for the
optimizers our engine built where upstream's would have built a BF16_Optimizer (the engine marks
them, engine_setup._optimizer_route; runtime/optimizer_routes.py). It cannot be constructed directly; build it through
`deepspeed.initialize`.
"""

from __future__ import annotations

from .optimizer_routes import RouteClass
from .universal_hooks import UniversalCheckpointHooks


class BF16_Optimizer(UniversalCheckpointHooks, RouteClass):  # noqa: N801 - upstream name
    """See the module docstring."""

    _lp_groups_attr = "bf16_groups"

    built_when = ("by deepspeed.initialize (bf16 with fp32 gradient accumulation, ZeRO stage 0, or stage 1 with "
                  "data_types.grad_accum_dtype=fp32)")


__all__ = ["BF16_Optimizer"]
