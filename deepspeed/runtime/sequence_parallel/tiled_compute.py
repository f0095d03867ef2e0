"""Tiled compute for long sequences (ALST): run a token-wise function over sequence shards so its
large intermediates (an MLP's 4x-wide activations, full-vocabulary logits) exist for one shard at a
time. Upstream's names and signatures (`deepspeed.runtime.sequence_parallel.ulysses_sp` re-exports
them): `TiledMLP`, `sequence_tiled_compute` / `SequenceTiledCompute`, `TiledFusedLogitsLoss`,
`TiledLoss`, `UlyssesSPFwdLossBwdWithLogits`.

[Note: tiled backward]
Forward runs `fn` on each shard under `no_grad` and keeps only the input. Backward recomputes one
shard at a time with grad enabled and runs a nested `torch.autograd.backward` on it, so parameter
gradients accumulate in `.grad` shard by shard. Every gradient here is produced inside the *outer*
backward (TiledFusedLogitsLoss too, unlike upstream's, which runs its backward inside forward): the
engine's gradient-accumulation and loss scaling, ZeRO's reduction and its end-of-backward epilogue all
see the gradients as in any backward, at the price of one more shard forward for the loss.
Each nested backward fires the parameters' post-accumulate hooks, so the shards but the last set
upstream's `param.ds_grad_is_ready = False` on `compute_params`: ZeRO (stage 1/2 buckets, stage-3
units) then waits for the last shard before it counts a gradient as complete. Under ZeRO-3 the
compute params are gathered once around each shard loop (`GatheredParameters`), so the collectives
do not depend on the shard count, which may then differ by rank (uneven sequence lengths).

Shards follow `torch.chunk`'s rule: ceil(n / shards) rows each, the last one shorter, and fewer
shards than asked when n is small (more shards than rows: one row each).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ._tiling import check_shards, gathered, grad_params, leaf, shard_backward, shard_bounds
from .tiled_loss import TiledFusedLogitsLoss, TiledLoss, UlyssesSPFwdLossBwdWithLogits


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x)` computed over `shards`
    slices of the token dims of `x` ([bs, seqlen, hidden] or [tokens, hidden]; bs and seqlen are
    flattened, so any token-wise function works). Activations inside `fn` exist for one slice at a
    time, in forward and backward (see [Note: tiled backward]). `compute_params`: the parameters
    `fn` uses (needed for ZeRO; None without it). Returns `fn(self, x)`'s value."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: torch.Tensor, shards: int, compute_params: Any) -> torch.Tensor:
        check_shards(shards, "TiledMLP")
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = grad_params(compute_params)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad(), gathered(ctx.params):
            outs = [fn(self, flat.narrow(0, start, size)) for start, size in shard_bounds(flat.shape[0], shards)]
        out = torch.cat(outs, dim=0)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        (x, ) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        x_grad = torch.zeros_like(flat) if ctx.needs_input_grad[2] else None

        def run_shard(i: int, start: int, size: int) -> None:
            piece = leaf(flat.narrow(0, start, size), x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            torch.autograd.backward(out, grad_flat.narrow(0, start, size))
            if x_grad is not None and piece.grad is not None:
                x_grad.narrow(0, start, size).copy_(piece.grad)

        shard_backward(ctx.params, shard_bounds(flat.shape[0], ctx.shards), run_shard)
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


class AutogradComputeMLP(torch.autograd.Function):
    """`AutogradComputeMLP.apply(fn, self, x)`: `fn(self, x)` with nothing kept but `x`, recomputed whole in
    backward (upstream's untiled form of TiledMLP, kept as the simplest recompute-in-backward example)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.module = fn, self
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(self, x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        (x, ) = ctx.saved_tensors
        piece = leaf(x, ctx.needs_input_grad[2])
        with torch.enable_grad():
            out = ctx.fn(ctx.module, piece)
        torch.autograd.backward(out, grad_out)
        return None, None, piece.grad


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict, kwargs_to_pass: dict,
                           grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> Any:
    """`fn(**kwargs_to_shard sliced on dim 1 (seqlen), **kwargs_to_pass)` over `shards` sequence
    slices, recomputed slice by slice in backward (see [Note: tiled backward]). Only
    `kwargs_to_shard[grad_requiring_tensor_key]` gets a gradient (tensors in kwargs_to_pass are
    treated as constants). Outputs are concatenated on `output_unshard_dimension` (0: each slice
    returns a scalar, e.g. a loss) and reduced by `output_reduction`: None, "mean" or "sum"."""
    keys = list(kwargs_to_shard) + list(kwargs_to_pass)
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} is not a "
                         f"key of kwargs_to_shard ({list(kwargs_to_shard)})")
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *[{**kwargs_to_shard, **kwargs_to_pass}[k] for k in keys])


_REDUCTIONS = (None, "mean", "sum")


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd Function behind `sequence_tiled_compute` (call that: it takes dicts)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list, keys_to_pass: list,
                grad_requiring_tensor_key: str, compute_params: Any, output_unshard_dimension: int,
                output_reduction: str | None, *args: Any) -> torch.Tensor:
        check_shards(shards, "sequence_tiled_compute")
        if output_reduction not in _REDUCTIONS:
            raise ValueError(f"sequence_tiled_compute: output_reduction={output_reduction!r} is not allowed: "
                             f"use None, 'mean' or 'sum'")
        n_shard = len(keys_to_shard)
        sharded = dict(zip(keys_to_shard, args[:n_shard]))
        for k, v in sharded.items():
            if not torch.is_tensor(v) or v.dim() < 2 or v.shape[1] != seqlen:
                got = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
                raise ValueError(f"sequence_tiled_compute: kwargs_to_shard[{k!r}] must be a tensor "
                                 f"[bs, seqlen={seqlen}, ...], got {got}")
        ctx.fn, ctx.dim, ctx.reduction = fn, output_unshard_dimension, output_reduction
        ctx.params = grad_params(compute_params)
        ctx.bounds = shard_bounds(seqlen, shards)
        ctx.keys_to_shard, ctx.key = keys_to_shard, grad_requiring_tensor_key
        ctx.index = (keys_to_shard + keys_to_pass).index(grad_requiring_tensor_key)
        ctx.passed = dict(zip(keys_to_pass, args[n_shard:]))
        ctx.save_for_backward(*args[:n_shard])
        with torch.no_grad(), gathered(ctx.params):
            outs = [fn(**{k: v.narrow(1, s, n) for k, v in sharded.items()}, **ctx.passed) for s, n in ctx.bounds]
        out = torch.stack(outs) if output_unshard_dimension == 0 else torch.cat(outs, dim=output_unshard_dimension)
        ctx.out_numel = out.numel()
        if output_reduction is None:
            return out
        return out.mean() if output_reduction == "mean" else out.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        sharded = dict(zip(ctx.keys_to_shard, ctx.saved_tensors))
        target = sharded[ctx.key]
        wants = ctx.needs_input_grad[9 + ctx.index]
        target_grad = torch.zeros_like(target) if wants else None
        if ctx.reduction == "mean":
            grad_out = grad_out / ctx.out_numel
        offsets = [0]   # where each slice's output starts on output_unshard_dimension

        def run_shard(i: int, start: int, size: int) -> None:
            inputs = {k: v.detach().narrow(1, start, size) for k, v in sharded.items()}
            inputs[ctx.key] = piece = leaf(inputs[ctx.key], wants)
            with torch.enable_grad():
                out = ctx.fn(**inputs, **ctx.passed)
            if ctx.reduction is not None:        # every element of the slice got d(sum)/d(x) = grad_out
                grad = grad_out.expand_as(out)
            elif ctx.dim == 0:
                grad = grad_out[i]
            else:
                grad = grad_out.narrow(ctx.dim, offsets[-1], out.shape[ctx.dim])
                offsets.append(offsets[-1] + out.shape[ctx.dim])
            torch.autograd.backward(out, grad)
            if wants and piece.grad is not None:
                target_grad.narrow(1, start, size).copy_(piece.grad)

        shard_backward(ctx.params, ctx.bounds, run_shard)
        arg_grads = [None] * (len(ctx.keys_to_shard) + len(ctx.passed))
        arg_grads[ctx.index] = target_grad
        return (None, ) * 9 + tuple(arg_grads)


__all__ = ["TiledMLP", "AutogradComputeMLP", "sequence_tiled_compute", "SequenceTiledCompute", "TiledFusedLogitsLoss",
           "TiledLoss", "UlyssesSPFwdLossBwdWithLogits", "shard_bounds"]
