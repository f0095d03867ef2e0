"""Expert parallelism under tensor parallelism: each tensor peer routes its share of the tokens.

[Note: EP x TP folding]
Tensor-parallel peers hold the same activations (the MoE block's input is replicated over the
tensor group). Experts that are not themselves tensor-parallel would see every token tp times, so
each tensor peer takes one contiguous share of the token rows (`split_over_tensor`: torch's
`tensor_split`, uneven shares allowed), dispatches only that share to the expert owners over its
expert-parallel group, and the peers' results are joined again (`join_over_tensor`). The backward
is Megatron's scatter/gather pair: the gradient of the joined output is replicated, so each peer
keeps its own share; the shares' input gradients are all-gathered, so every peer gets the whole
input gradient, as the layers before it expect (the router and everything dense see identical
gradients on the tensor peers). Each token's assignment is computed once in the tensor group, so
an expert's gradient is the sum over the ranks holding that expert (`ParallelMesh.expert_holders`:
the expert-data-parallel group, plus the tensor peers in upstream's E + M + D layout) divided by
the data-parallel size, and the global norm counts each expert element once: ZeRO 1/2 shards it
over the holders, without ZeRO only the first holder counts it (runtime/engine_moe.py).

The two layouts: AutoEP with AutoTP folds the expert groups over the tensor dim as upstream's
auto_ep_folding (runs of ep consecutive ranks, which may span tensor groups; world 4 = tp 2 x ep 2:
expert groups {0,1} {2,3} = the tensor groups, expert-data groups {0,2} {1,3}); `MoE` with a client
`mpu` keeps upstream's E + M + D (expert groups inside each tensor lane: {0,2} {1,3}, tensor peers
hold the same experts). Upstream splits the capacity dim of `MoE`'s [E, C, M] dispatch buffer the
same way (its `drop_tokens` / `gather_tokens`), and so does `MoE` here (sharded_moe.py). AutoEP's
layers share the routed (token, expert) assignments instead of the token rows ([Note: folded
assignment dispatch] in moe/ep_tp_dispatch.py); the gradient rule above is the same for both.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm as ds_comm


def _shares(n: int, world: int) -> list[int]:
    """The share sizes torch's tensor_split cuts n into (the first n % world one longer)."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, world: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.world, ctx.total = dim, group, world, x.shape[dim]
        return x.tensor_split(world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather(grad.contiguous(), ctx.dim, ctx.group, ctx.world, ctx.total), None, None, None, None


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, world: int, rank: int, total: int) -> torch.Tensor:
        ctx.dim, ctx.world, ctx.rank = dim, world, rank
        return _gather(x.contiguous(), dim, group, world, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad.tensor_split(ctx.world, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None, None


def _gather(x: torch.Tensor, dim: int, group: Any, world: int, total: int) -> torch.Tensor:
    """The peers' shares of a `total`-long `dim` (cut as tensor_split cuts it), joined in rank order;
    shorter shares travel padded to the longest."""
    sizes = _shares(total, world)
    longest = sizes[0]
    moved = x.movedim(dim, 0)
    if moved.shape[0] < longest:
        pad = moved.new_zeros((longest - moved.shape[0],) + tuple(moved.shape[1:]))
        moved = torch.cat([moved, pad])
    parts = [torch.empty_like(moved) for _ in range(world)]
    ds_comm.all_gather(parts, moved.contiguous(), group=group)
    joined = torch.cat([part[:size] for part, size in zip(parts, sizes)])
    return joined.movedim(0, dim).contiguous()


def split_over_tensor(x: torch.Tensor, group: Any, world: int, rank: int, dim: int = 0) -> torch.Tensor:
    """This tensor peer's share of `x` along `dim` (backward: the whole gradient, all-gathered)."""
    if world <= 1:
        return x
    return _Split.apply(x, dim, group, world, rank)


def join_over_tensor(x: torch.Tensor, group: Any, world: int, rank: int, total: int, dim: int = 0) -> torch.Tensor:
    """The tensor peers' shares joined into the `total`-long `dim` (backward: this peer's share)."""
    if world <= 1:
        return x
    return _Join.apply(x, dim, group, world, rank, total)

