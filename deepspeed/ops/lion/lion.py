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

from deepspeed.ops._multi_tensor import Bucket, gather, load_state_dict_keeping_dtypes, scalar

_CPU = torch.device("cpu")


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


class _LionBase(torch.optim.Optimizer):
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
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, dtype=self._state_dtype or param.dtype),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like ``torch.optim``, but keep fp32 moments of low-precision params in fp32."""
        load_state_dict_keeping_dtypes(self, super().load_state_dict, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one Lion update to every param that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            bucket = gather(self, group, self._init_state)
            if bucket.params:
                lion_update(bucket, group)
                bucket.write_back()
        return loss


class FusedLion(_LionBase):
    """Lion with upstream ``FusedLion``'s signature; moments in the param dtype."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr, betas, weight_decay, state_dtype=None)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        """One optimizer step. The extra arguments are upstream's deprecated ones and must be None."""
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError(
                "FusedLion has been updated. Simply initialize it identically to torch.optim.Adam, "
                "and call step() with no arguments."
            )
        return super().step(closure)


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
