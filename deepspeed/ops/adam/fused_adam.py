"""FusedAdam: DeepSpeed's Adam/AdamW, running on torch's fused or foreach kernels.

Upstream FusedAdam is a CUDA multi-tensor kernel. Its math is exactly torch's Adam
(``adam_w_mode=False``: L2 penalty added to the gradient) or AdamW (``adam_w_mode=True``:
decoupled decay ``p *= 1 - lr * wd``), with the denominator ``sqrt(v / bc2) + eps``.
So the bias-corrected case calls ``torch.optim``'s functional kernels, fused wherever
torch has a fused kernel for the device (CUDA, and CPU since torch 2.4).

``bias_correction=False`` has no torch flag; :func:`adam_update_uncorrected` implements
that case with ``torch._foreach_*`` ops (the upstream kernel with ``bc1 = bc2 = 1``).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.adamw import adamw as _torch_adamw

from deepspeed.ops._multi_tensor import Bucket, ForeachOptimizer, FusedCompat, fused_adam_supported, scalar

_CPU = torch.device("cpu")  # host: step counters, as torch.optim keeps them


def _step_device(param: torch.Tensor) -> torch.device:
    """Where a param's step counter lives: with the param when a fused kernel runs there."""
    return param.device if fused_adam_supported(param.device) else _CPU


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Reject values for which Adam-style updates are undefined (torch.optim does the same)."""
    if not 0.0 <= scalar(lr):
        raise ValueError(f"lr: got {lr}; expected a value >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"eps: got {eps}; expected a value >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas: got {betas}; expected two values in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay: got {weight_decay}; expected a value >= 0")


def adam_update_torch(bucket: Bucket, group: dict, adam_w_mode: bool) -> None:
    """Bias-corrected Adam(W) on torch's kernels: one fused kernel where supported."""
    fused = all(fused_adam_supported(p.device) for p in bucket.params)
    beta1, beta2 = group["betas"]
    kernel = _torch_adamw if adam_w_mode else _torch_adam
    kernel(
        bucket.params, bucket.grads, bucket.state("exp_avg"), bucket.state("exp_avg_sq"), [],
        bucket.steps(_step_device),
        foreach=not fused, fused=fused or None,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=scalar(group["lr"]),
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
    )  # fmt: skip


def adam_update_uncorrected(bucket: Bucket, group: dict, adam_w_mode: bool) -> None:
    """Adam(W) without bias correction: ``p -= lr * (m / (sqrt(v) + eps) [+ wd * p])``."""
    params, grads = bucket.params, bucket.grads
    exp_avgs, exp_avg_sqs = bucket.state("exp_avg"), bucket.state("exp_avg_sq")
    beta1, beta2 = group["betas"]
    lr, wd, eps = scalar(group["lr"]), group["weight_decay"], group["eps"]
    torch._foreach_add_(bucket.steps(_step_device), 1)
    if wd and not adam_w_mode:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m = b1 * m + (1 - b1) * g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps)
    if wd and adam_w_mode:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)


class AdamBase(ForeachOptimizer):
    """Shared Adam(W) step for :class:`FusedAdam` and ``DeepSpeedCPUAdam``.

    The two differ only in constructor vocabulary and in the dtype of the moments
    (``state_dtype=None`` keeps them in the param dtype). Each param group may set its
    own ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``bias_correction``.
    """

    def __init__(self, params, defaults: dict, adam_w_mode: bool, state_dtype: torch.dtype | None):
        check_hyperparameters(defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"])
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self._state_dtype = state_dtype

    def _init_state(self, param: torch.Tensor) -> dict:
        dtype = self._state_dtype or param.dtype
        return {
            "step": torch.zeros((), dtype=torch.float32, device=_step_device(param)),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }

    def _update(self, bucket: Bucket, group: dict) -> None:
        if group["bias_correction"]:
            adam_update_torch(bucket, group, bool(self.adam_w_mode))
        else:
            adam_update_uncorrected(bucket, group, bool(self.adam_w_mode))


class FusedAdam(FusedCompat, AdamBase):
    """Adam/AdamW with DeepSpeed's ``FusedAdam`` signature (drop-in for ``torch.optim.AdamW``).

    Args mirror upstream: ``adam_w_mode=True`` selects decoupled weight decay (AdamW),
    ``False`` the L2 penalty of Adam. ``amsgrad`` is refused as upstream does.
    ``set_grad_none`` is the default of :meth:`zero_grad`. Moments are kept in the
    param dtype, as upstream.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, adam_w_mode=bool(adam_w_mode), state_dtype=None)
        self.adam_w_mode = 1 if adam_w_mode else 0  # upstream stores the kernel's mode flag
        self.set_grad_none = set_grad_none
