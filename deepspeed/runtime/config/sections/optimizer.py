"""`optimizer` and `scheduler`: which class the engine builds and with which keyword arguments.

`params` is passed through to the optimizer/scheduler constructor, so its keys are not checked
here (the constructor checks them); "auto" values in it are dropped so the constructor's own
default applies, as upstream does.
"""

from __future__ import annotations

from typing import Any, Iterator

from pydantic import Field

from deepspeed.utils.logging import logger

from .base import DSModel, Problem

# Optimizer names upstream matches case-insensitively (runtime/config.py DEEPSPEED_OPTIMIZERS).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


class OptimizerConfig(DSModel):
    """`optimizer`: {"type": "AdamW", "params": {"lr": 1e-4, ...}}."""

    type: str
    """Optimizer name: a DeepSpeed name (Adam, AdamW, Lamb, ...) or a torch.optim class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer constructor."""
    legacy_fusion: bool = False
    """Upstream legacy fused-optimizer switch (kept for compatibility)."""

    @property
    def name(self) -> str:
        """Upstream's `optimizer_name`: DeepSpeed names lower-cased, others as written."""
        return self.type.lower() if self.type.lower() in DEEPSPEED_OPTIMIZERS else self.type

    def _problems(self) -> Iterator[Problem]:
        max_grad_norm = self.params.get("max_grad_norm")
        if isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0:
            # Upstream warns and ignores it; the engine clips with `gradient_clipping` only.
            logger.warning(
                f"optimizer.params.max_grad_norm ({max_grad_norm}) is ignored as an optimizer parameter; "
                "use the top-level 'gradient_clipping' key")
        return iter(())


class SchedulerConfig(DSModel):
    """`scheduler`: {"type": "WarmupLR", "params": {...}}."""

    type: str
    """Scheduler name (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, ...)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler constructor."""
