# compat: upstream path deepspeed.runtime.fp16.fused_optimizer (DeepSpeed 0.19.8 name).
"""`FP16_Optimizer`: upstream's fp16 (or bf16 with bf16 gradient accumulation) wrapper without ZeRO
for fused optimizers (FusedAdam). Ours is MixedPrecisionOptimizer, marked with this route
(runtime/optimizer_routes.py); `fp32_groups_flat` gives its masters per group as upstream."""

from ..optimizer_routes import RouteClass


class FP16_Optimizer(RouteClass):  # noqa: N801 - upstream name
    built_when = "by deepspeed.initialize (fp16 without ZeRO, with a fused optimizer such as FusedAdam)"


__all__ = ["FP16_Optimizer"]
