"""Autograd pieces of the transformer layer that keep fewer activations than plain autograd would.

Each one trades saved bytes for recomputation in backward and yields the same values as the
plain composition (see [Note: dropout masks]). They save parameters as the leaf tensors themselves
(never casts or slices of them), so ZeRO-3's just-in-time gathering sees the same objects that
``F.linear`` would save.

[Note: dropout masks]
Every dropout mask of a layer call comes from one private generator seeded with a number drawn
from torch's default CPU generator (mixed with ``config.seed``). So ``torch.manual_seed`` makes runs
reproducible, a recomputation under activation checkpointing (which restores the CPU RNG state)
draws the same masks, and a mask can be regenerated in backward from its seed instead of being
kept: that is what ``attn_dropout_checkpoint`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GENERATORS: dict[torch.device, torch.Generator] = {}


def draw_seed(mix: int) -> int:
    """A 62-bit seed from torch's default CPU generator (no device sync), mixed with ``mix``."""
    seed = int(torch.randint(0, 2**62, (1,)).item())   # host: a seed, read back as a number
    return seed ^ (mix & (2**62 - 1))


def keep_mask(shape, keep_prob: float, seed: int, device: torch.device) -> torch.Tensor:
    """Boolean keep-mask (True with probability ``keep_prob``), a pure function of ``seed``."""
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(keep_prob, generator=gen)


class DropoutAdd(torch.autograd.Function):
    """``residual + dropout(x)`` with a seeded mask, keeping only the boolean mask (1 byte per
    element) and allocating one tensor each way (autograd's where/mul/add chain makes three)."""

    @staticmethod
    def forward(ctx, x, residual, p, seed):
        keep = keep_mask(x.shape, 1.0 - p, seed, x.device)
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.add(residual, x * keep, alpha=ctx.scale)

    @staticmethod
    def backward(ctx, grad_out):
        (keep,) = ctx.saved_tensors
        return (grad_out * keep).mul_(ctx.scale), grad_out, None, None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class GeluLinear(torch.autograd.Function):
    """``linear(gelu(x), w, b)`` keeping only ``x``: GELU is recomputed in backward (gelu_checkpoint)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(x), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = _flat(grad_out).t().mm(_flat(F.gelu(x)))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _flat(grad_out).sum(0)
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.gelu_backward(grad_out.matmul(weight), x)
        return grad_x, grad_w, grad_b


class InvertibleLayerNorm(torch.autograd.Function):
    """LayerNorm that keeps its output, not its input (normalize_invertible).

    The normalized input is recovered in backward as ``(y - bias) / weight``; the output is
    usually kept anyway (by the next linear or as the next layer's input), so the input's bytes
    are saved. Like upstream's invertible kernel it needs a weight without zeros.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        y, weight, bias, rstd = ctx.saved_tensors
        acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
        w = weight.to(acc)
        x_hat = (y.to(acc) - bias.to(acc)) / w
        dy = grad_y.to(acc)
        g = dy * w
        grad_x = (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd
        grad_w = (_flat(dy) * _flat(x_hat)).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = _flat(dy).sum(0).to(bias.dtype) if ctx.needs_input_grad[2] else None
        return grad_x.to(y.dtype), grad_w, grad_b, None


def _probs(q, k, mask, scale):
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if mask is not None:
        scores.add_(mask)
    return torch.softmax(scores, dim=-1)


class DropoutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T * scale + mask)) @ v`` with a seeded dropout mask.

    Default: keeps the probabilities and the boolean mask (5 bytes per score in fp32, against 9
    for autograd's softmax + dropout + matmul). With ``recompute`` (attn_dropout_checkpoint) it
    keeps no score-sized tensor at all: backward recomputes the probabilities from q and k and
    regenerates the mask from its seed. The 1/(1-p) scaling is applied to the small [S, d] side.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, p, seed, recompute):
        scale = q.shape[-1] ** -0.5
        probs = _probs(q, k, mask, scale)
        keep = keep_mask(probs.shape, 1.0 - p, seed, probs.device)
        out = torch.matmul(probs * keep, v).mul_(1.0 / (1.0 - p))
        ctx.scale, ctx.p, ctx.seed, ctx.recompute = scale, p, seed, recompute
        if recompute:
            ctx.save_for_backward(q, k, v, mask)
        else:
            ctx.save_for_backward(q, k, v, mask, probs, keep)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.recompute:
            q, k, v, mask = ctx.saved_tensors
            probs = _probs(q, k, mask, ctx.scale)
            keep = keep_mask(probs.shape, 1.0 - ctx.p, ctx.seed, probs.device)
        else:
            q, k, v, mask, probs, keep = ctx.saved_tensors
        grad_out = grad_out * (1.0 / (1.0 - ctx.p))
        grad_v = torch.matmul((probs * keep).transpose(-2, -1), grad_out)
        grad_probs = torch.matmul(grad_out, v.transpose(-2, -1)).mul_(keep)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_q = torch.matmul(grad_scores, k).mul_(ctx.scale)
        grad_k = torch.matmul(grad_scores.transpose(-2, -1), q).mul_(ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None, None
