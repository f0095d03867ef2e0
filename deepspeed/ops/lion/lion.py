"""Lion (EvoLved Sign Momentum), as DeepSpeed's ``FusedLion`` and ``DeepSpeedCPULion``.

Update, per element, with ``m`` the momentum (Chen et al. 2023, and upstream's kernels):

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g

One deliberate difference: where ``c`` is exactly zero we apply no update
(``torch.sign(0) == 0``, as in the paper), while upstream's kernels move by ``+-lr``
depending on the sign bit of zero (and disagree between their CPU and CUDA builds).
"""

from __future__ import annotations

import torch

from deepspeed.ops._multi_tensor import Bucket, ForeachOptimizer, FusedCompat, scalar

_CPU = torch.device("cpu")  # host: step counters, as torch.optim keeps them


def lion_update(bucket: Bucket, group: dict) -> None:
    """Apply one Lion step to every slot of ``bucket`` with ``torch._foreach_*`` ops."""
    params, grads, exp_avgs = bucket.params, bucket.grads, bucket.state("exp_avg")
    beta1, beta2 = group["betas"]
    lr, wd = scalar(group["lr"]), group["weight_decay"]
    torch._foreach_add_(bucket.steps(lambda p: _CPU), 1)
    direction = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)  # b1 * m + (1 - b1) * g
    torch._foreach_sign_(direction)
    if wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)


class _LionBase(ForeachOptimizer):
    """Shared Lion step; subclasses choose the moment dtype (None: the param's)."""

    def __init__(self, params, lr, betas, weight_decay, state_dtype: torch.dtype | None):
        if not 0.0 <= scalar(lr):
            raise ValueError(f"lr: got {lr}; expected a value >= 0")
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"betas: got {betas}; expected two values in [0, 1]")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self._state_dtype = state_dtype

    def _init_state(self, param: torch.Tensor) -> dict:
        return {
            "step": torch.zeros((), dtype=torch.float32),  # host: torch.optim's step counter
            "exp_avg": torch.zeros_like(param, dtype=self._state_dtype or param.dtype),
        }

    def _update(self, bucket: Bucket, group: dict) -> None:
        lion_update(bucket, group)


class FusedLion(FusedCompat, _LionBase):
    """Lion with upstream ``FusedLion``'s signature; moments in the param dtype."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr, betas, weight_decay, state_dtype=None)
        self.set_grad_none = set_grad_none


class DeepSpeedCPULion(_LionBase):
    """Lion for ZeRO-Offload (upstream ``DeepSpeedCPULion`` signature).

    ``fp32_optimizer_states=True`` keeps the momentum in fp32 for bf16/fp16 params.
    """

    optimizer_id = 0  # upstream numbers instances for its C++ registry; kept for compatibility

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        state_dtype = torch.float32 if fp32_optimizer_states else None
        super().__init__(model_params, lr, betas, weight_decay, state_dtype=state_dtype)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPULion.optimizer_id
        DeepSpeedCPULion.optimizer_id += 1
