# compat: upstream path deepspeed.runtime.fp16.unfused_optimizer (DeepSpeed 0.19.8 name).
"""`FP16_UnfusedOptimizer`: upstream's fp16 wrapper without ZeRO for other optimizers (Lamb, SGD,
torch optimizers). Ours is MixedPrecisionOptimizer, marked with this route
(runtime/optimizer_routes.py); `fp32_groups` gives its masters per group as upstream."""

from ..optimizer_routes import RouteClass


class FP16_UnfusedOptimizer(RouteClass):  # noqa: N801 - upstream name
    built_when = "by deepspeed.initialize (fp16 without ZeRO, with an optimizer that is not fused)"


__all__ = ["FP16_UnfusedOptimizer"]
