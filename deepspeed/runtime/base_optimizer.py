# compat: marker base classes that libraries check with isinstance().
"""`DeepSpeedOptimizer` and `ZeROOptimizer` (upstream names). Our ZeRO optimizer derives from them."""


class DeepSpeedOptimizer:
    """Base of every optimizer wrapper the engine creates (fp16/bf16 wrappers, ZeRO)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Base of the ZeRO optimizers (stages 1-3)."""
