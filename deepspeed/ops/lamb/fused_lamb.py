"""FusedLamb: DeepSpeed's LAMB, on ``torch._foreach_*`` ops.

Per parameter tensor (upstream ``csrc/lamb`` kernel, bias correction folded into the
step size rather than into ``m`` and ``v``):

    g        = grad / combined_scale
    m        = b1 * m + (1 - b1) * g
    v        = b2 * v + (1 - b2) * g * g
    denom    = sqrt(v + eps)  if eps_inside_sqrt  else  sqrt(v) + eps
    update   = m / denom + wd * p
    coeff    = clamp(||p|| / ||update||, min_coeff, max_coeff)   (1 if either norm is 0)
    step     = lr * sqrt(1 - b2^t) / (1 - b1^t)   if bias_correction  else  lr
    p        = p - step * coeff * update

``combined_scale`` is the loss ``scale`` passed to :meth:`FusedLamb.step`, raised to
``clip * scale`` when ``max_grad_norm > 0`` and the given grad norm exceeds it.
"""

from __future__ import annotations

import math

import torch

from deepspeed.ops._multi_tensor import scalar


def _per_group(value, num_groups: int, what: str) -> list:
    """Normalise upstream's ``grads``/``output_params`` step arguments to one list per group."""
    if value is None:
        return [None] * num_groups
    value = list(value)
    if num_groups == 1 and (not value or not isinstance(value[0], (list, tuple))):
        value = [value]  # a flat list means "the single group"
    if len(value) != num_groups:
        raise ValueError(f"{what}: got {len(value)} entries; expected one per param group ({num_groups})")
    return value


def _grad_norms_per_group(grad_norms, num_groups: int) -> list:
    """``grad_norms`` as one entry per group: a scalar for the whole group or a per-param list."""
    if grad_norms is None:
        return [None] * num_groups
    if not isinstance(grad_norms, (list, tuple)):
        return [grad_norms] * num_groups
    if len(grad_norms) != num_groups:
        raise ValueError(f"grad_norms: got {len(grad_norms)} entries; expected one per param group ({num_groups})")
    return list(grad_norms)


def _trust_ratios(params, updates, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """Per-tensor LAMB coefficients ``clamp(||p|| / ||u||)``, 1 where either norm is zero."""
    w_norm = torch.stack(torch._foreach_norm(params)).float()
    u_norm = torch.stack(torch._foreach_norm(updates)).float()
    ratio = (w_norm / u_norm).clamp(min=min_coeff, max=max_coeff)
    return torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))


class FusedLamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019) with upstream ``FusedLamb``'s signature and math.

    After each step, :meth:`get_lamb_coeffs` returns the trust ratio applied to each
    parameter, as upstream does. ``amsgrad`` is refused as upstream.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        amsgrad=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        if not 0.0 <= scalar(lr):
            raise ValueError(f"lr: got {lr}; expected a value >= 0")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"min_coeff/max_coeff: got {min_coeff}/{max_coeff}; expected 0 < min_coeff <= max_coeff")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # upstream's kernel flag: 0 puts eps inside the sqrt
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        """One LAMB step.

        Args (beyond ``closure``, all upstream's legacy fp16 interface):
            grads: per-group lists of gradients to use instead of ``p.grad``.
            output_params: per-group lists of tensors that receive a copy of the updated params.
            scale: loss scale the gradients are divided by.
            grad_norms: per-group grad norm (scalar, or one per param) for ``max_grad_norm`` clipping.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        per_group = zip(
            self.param_groups,
            _per_group(grads, n, "grads"),
            _per_group(output_params, n, "output_params"),
            _grad_norms_per_group(grad_norms, n),
        )
        self.lamb_coeffs = []
        for group, group_grads, group_out, group_norm in per_group:
            self._step_group(group, group_grads, group_out, group_norm, scale)
        return loss

    def _step_group(self, group, grads, out_params, grad_norm, scale) -> None:
        """Collect one group's tensors, then apply the LAMB update to all of them at once."""
        params, used_grads, scales, states, outs = [], [], [], [], []
        grads = grads if grads is not None else [None] * len(group["params"])
        out_params = out_params if out_params is not None else [None] * len(group["params"])
        norms = grad_norm if isinstance(grad_norm, (list, tuple)) else [grad_norm] * len(group["params"])
        if not len(grads) == len(out_params) == len(norms) == len(group["params"]):
            raise ValueError("grads, output_params and grad_norms need one entry per parameter of the group")
        for param, grad, out, norm in zip(group["params"], grads, out_params, norms):
            grad = param.grad if grad is None else grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("FusedLamb does not support sparse gradients")
            state = self.state[param]
            if len(state) == 0:
                state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
            state["step"] = int(state["step"]) + 1
            params.append(param)
            used_grads.append(grad.to(param.dtype))
            scales.append(self._combined_scale(group, norm, scale))
            states.append(state)
            outs.append(out)
        if params:
            self._apply(group, params, used_grads, scales, states)
            for param, out in zip(params, outs):
                if out is not None:
                    out.copy_(param)

    @staticmethod
    def _combined_scale(group: dict, grad_norm, scale: float) -> float:
        """The divisor for the grads: the loss scale, raised when the grad norm needs clipping."""
        max_norm = group["max_grad_norm"]
        if max_norm > 0 and grad_norm is not None:
            clip = (scalar(grad_norm) / scale + 1e-6) / max_norm
            if clip > 1:
                return clip * scale
        return scale

    def _apply(self, group, params, grads, scales, states) -> None:
        """The LAMB math of the module docstring, over lists of tensors."""
        beta1, beta2 = group["betas"]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if any(s != 1.0 for s in scales):
            grads = torch._foreach_div(grads, scales)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if self.eps_mode == 0:
            denom = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        coeffs = _trust_ratios(params, updates, group["min_coeff"], group["max_coeff"]).tolist()
        lr = scalar(group["lr"])
        step_sizes = [self._step_size(lr, beta1, beta2, s["step"], group["bias_correction"]) for s in states]
        torch._foreach_mul_(updates, [-size * coeff for size, coeff in zip(step_sizes, coeffs)])
        torch._foreach_add_(params, updates)
        self.lamb_coeffs.extend(coeffs)

    @staticmethod
    def _step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
        """``lr`` with Adam's bias corrections folded in, as upstream's kernel does."""
        if not bias_correction:
            return lr
        return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last step, one per updated parameter, in group order."""
        return list(self.lamb_coeffs)
