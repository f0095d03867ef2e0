"""ZeRO-3's linear autograd function, for code that calls it by name.

Upstream routes ``F.linear`` through ``LinearFunctionForZeroStage3`` under ZeRO-3 so that autograd
does not keep a reference to the gathered weight between forward and backward. Ours does not need it
(a unit's storage is released after forward and gathered again before backward whatever op used
it), so the engine never patches ``F.linear``; these names remain for code that calls them directly.
The function is a real linear with its own backward, written in the ``setup_context`` form so that
``torch.func`` transforms (grad, vmap) work through it, and it replays forward's autocast state in
backward, as ``torch.amp.custom_bwd`` does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...accelerator import get_accelerator


def noop_decorator(func):
    return func


def _autocast_decorators():
    device_type = get_accelerator().device_name()
    amp = torch.amp
    if hasattr(amp, "custom_fwd"):   # torch >= 2.4
        return (functools.partial(amp.custom_fwd, device_type=device_type),
                functools.partial(amp.custom_bwd, device_type=device_type))
    legacy = getattr(getattr(torch, device_type, None), "amp", None)
    return getattr(legacy, "custom_fwd", noop_decorator), getattr(legacy, "custom_bwd", noop_decorator)


autocast_custom_fwd, autocast_custom_bwd = _autocast_decorators()


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``input @ weight.T + bias`` with an explicit backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        return F.linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = (tuple(inputs) + (None, ))[:3]
        device_type = get_accelerator().device_name()
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        ctx._dtype = torch.get_autocast_dtype(device_type)
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        device_type = get_accelerator().device_name()
        # Backward runs under forward's autocast state, not whatever surrounds the backward call.
        with torch.autocast(device_type=device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                if grad_output.dim() == 1:   # unbatched input
                    grad_weight = torch.outer(grad_output, input)
                else:
                    grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                        input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if grad_output.dim() > 1 \
                    else grad_output
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Linear):
    """``nn.Linear`` whose forward goes through ``LinearFunctionForZeroStage3``."""

    def forward(self, input):
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)


__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap",
           "autocast_custom_fwd", "autocast_custom_bwd", "noop_decorator"]
