"""DeepSpeedCPUAdagrad: DeepSpeed's CPU Adagrad, on ``torch._foreach_*`` ops.

Update, per element (upstream's kernel; equal to ``torch.optim.Adagrad`` with
``lr_decay=0`` and ``initial_accumulator_value=0``, but the state key is ``exp_avg_sq``
as in upstream checkpoints rather than torch's ``sum``):

    g = g + wd * p
    v = v + g * g
    p = p - lr * g / (sqrt(v) + eps)

Sparse gradients (e.g. ``nn.Embedding(sparse=True)``) are supported as upstream does:
only the touched entries are updated, weight decay included.
"""

from __future__ import annotations

import torch

from deepspeed.ops._multi_tensor import Bucket, ForeachOptimizer, scalar

_CPU = torch.device("cpu")  # host: step counters, as torch.optim keeps them


def adagrad_update(bucket: Bucket, group: dict) -> None:
    """Apply one Adagrad step to the dense-gradient slots of ``bucket``."""
    params, grads, sums = bucket.params, bucket.grads, bucket.state("exp_avg_sq")
    lr, wd, eps = scalar(group["lr"]), group["weight_decay"], group["eps"]
    if wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_addcmul_(sums, grads, grads)
    denom = torch._foreach_sqrt(sums)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, grads, denom, value=-lr)


def _effective_grad(param: torch.Tensor, grad: torch.Tensor, wd: float) -> torch.Tensor:
    """``grad + wd * param`` as a dense tensor; for a sparse grad only touched entries decay.

    Untouched entries of a sparse grad stay exactly zero, so the update leaves them unchanged.
    """
    if not grad.is_sparse:
        return grad.add(param, alpha=wd) if wd else grad
    grad = grad.coalesce().to(param.dtype)
    dense = grad.to_dense()
    if wd:
        touched = torch.zeros(grad.shape[: grad.sparse_dim()], dtype=torch.bool, device=grad.device)
        touched[tuple(grad.indices())] = True
        touched = touched.view(touched.shape + (1,) * grad.dense_dim())  # broadcast over dense dims
        dense.add_(param * touched, alpha=wd)
    return dense


class DeepSpeedCPUAdagrad(ForeachOptimizer):
    """Adagrad with upstream ``DeepSpeedCPUAdagrad``'s signature.

    ``amsgrad`` is accepted and ignored, as upstream. ``fp32_optimizer_states=True``
    keeps the accumulator in fp32 for bf16/fp16 params.
    """

    _sparse_ok = True  # sparse gradients update only the touched entries, as upstream
    optimizer_id = 0  # upstream numbers instances for its C++ registry; kept for compatibility

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        if not 0.0 <= scalar(lr):
            raise ValueError(f"lr: got {lr}; expected a value >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"eps: got {eps}; expected a value >= 0")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdagrad.optimizer_id
        DeepSpeedCPUAdagrad.optimizer_id += 1

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def _init_state(self, param: torch.Tensor) -> dict:
        dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
        return {"step": torch.zeros((), dtype=torch.float32),  # host: torch.optim's step counter
                "exp_avg_sq": torch.zeros_like(param, dtype=dtype)}

    def _update(self, bucket: Bucket, group: dict) -> None:
        torch._foreach_add_(bucket.steps(lambda p: _CPU), 1)
        if any(g.is_sparse for g in bucket.grads):
            # Fold weight decay into every grad here (sparse: touched entries only).
            wd = group["weight_decay"]
            bucket.grads = [_effective_grad(p, g, wd) for p, g in zip(bucket.params, bucket.grads)]
            adagrad_update(bucket, dict(group, weight_decay=0.0))
        else:
            adagrad_update(bucket, group)
