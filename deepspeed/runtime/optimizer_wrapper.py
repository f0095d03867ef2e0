"""The torch.optim.Optimizer-like surface shared by the engine's optimizer wrappers.

LR schedulers, users and frameworks read `param_groups`, `state`, `loss_scale` and call
`needs_scaler()` / `scale_if_loss()` on whatever `engine.optimizer` is; the wrappers
(MixedPrecisionOptimizer at stage 0, ZeroOptimizer at stages 1-2) differ only in how they step.
"""

from __future__ import annotations

from typing import Any

import torch

from .base_optimizer import DeepSpeedOptimizer


class OptimizerWrapper(DeepSpeedOptimizer):
    """Delegates the optimizer surface to `self.optimizer` and the loss scale to `self.loss_scaler`."""

    optimizer: torch.optim.Optimizer
    loss_scaler: Any
    _global_grad_norm: float | None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    cur_scale = loss_scale

    def needs_scaler(self) -> bool:
        """True when backward must scale the loss (fp16; seed 003's name)."""
        return self.loss_scaler.dynamic or self.loss_scaler.loss_scale != 1.0

    def scale_if_loss(self, value: Any) -> Any:
        """Scale `value` by the loss scale if it is a scalar tensor that can be backpropagated."""
        if torch.is_tensor(value) and value.numel() == 1 and value.requires_grad:
            return self.loss_scaler.scale(value)
        return value
