"""Ulysses attention (Megatron-DeepSpeed's `DistributedAttention`): sequence shards <-> head shards.

Each rank holds `s/P` tokens of every head; attention needs every token, so one all-to-all per q, k, v
trades that for all `s` tokens of `H/P` heads, local attention runs, and one all-to-all brings the output
back to sequence shards. Every exchange is `deepspeed.comm.all_to_all_single` (counted by
`deepspeed.comm.comms_counter`), differentiable: the backward of an exchange is the reverse exchange.

[Note: one exchange, any layout] An exchange is described by the dimension it scatters (cut into one
piece per rank, `scatter_sizes`) and the dimension it gathers (the pieces received from the ranks are
concatenated along it, `gather_sizes`). The layout (`[s, b, h, d]`, `[b, s, h, d]`, 3-D) follows from the
two indices alone, and the backward is the same exchange with the roles swapped, so uneven head counts
(7 heads on 4 ranks: 2, 2, 2, 1, the first `H % P` ranks one more, as upstream's `get_shard_size_list`)
need no separate path. Pieces travel as one flat buffer with per-rank split sizes, so every piece may
have its own shape.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.nn import Module

from .. import comm as ds_comm


def shard_sizes(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` near-even sizes, the first `total % parts` one larger."""
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group: Any, scatter_sizes: Sequence[int],
              gather_sizes: Sequence[int]) -> Tensor:
    """Send piece j of `x` (cut along `scatter_dim` by `scatter_sizes`) to rank j; concatenate the pieces
    received from every rank along `gather_dim` (rank j's piece is `gather_sizes[j]` long there)."""
    world = ds_comm.get_world_size(group)
    rank = ds_comm.get_rank(group)
    if len(scatter_sizes) != world or sum(scatter_sizes) != x.shape[scatter_dim]:
        raise ValueError(f"all-to-all: scatter sizes {list(scatter_sizes)} do not split dim {scatter_dim} "
                         f"(size {x.shape[scatter_dim]}) over {world} ranks")
    if len(gather_sizes) != world or gather_sizes[rank] != x.shape[gather_dim]:
        raise ValueError(f"all-to-all: gather sizes {list(gather_sizes)} do not match this rank's dim "
                         f"{gather_dim} (size {x.shape[gather_dim]}) over {world} ranks")
    pieces = x.split(list(scatter_sizes), dim=scatter_dim)
    send = torch.cat([p.reshape(-1) for p in pieces]) if world > 1 else pieces[0].reshape(-1)
    in_splits = [p.numel() for p in pieces]
    # what rank j sends me: my share of the scatter dim, rank j's length of the gather dim
    recv_shapes = []
    for j in range(world):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[rank]
        shape[gather_dim] = gather_sizes[j]
        recv_shapes.append(shape)
    out_splits = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    ds_comm.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    parts = [chunk.view(shape) for chunk, shape in zip(recv.split(out_splits), recv_shapes)]
    return torch.cat(parts, dim=gather_dim)


def _gather_sizes(x: Tensor, gather_idx: int, group: Any, world: int,
                  given: Optional[Sequence[int]]) -> list[int]:
    """Every rank's length of the gathered dim: as given, else asked of the group (one small all_gather;
    heads coming back after an uneven split differ by rank, and only the group knows them)."""
    if given is not None:
        return [int(n) for n in given]
    if world == 1:
        return [x.shape[gather_idx]]
    mine = torch.tensor([x.shape[gather_idx]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    ds_comm.all_gather(sizes, mine, group=group)
    return [int(n.item()) for n in sizes]


def all_gather_varlen(x: Tensor, dim: int, group: Any, lengths: Optional[Sequence[int]] = None) -> list[Tensor]:
    """Every rank's `x`, whose size along `dim` may differ by rank, in rank order: padded with zeros to the
    longest (gloo gathers equal shapes only), gathered, cut back. `lengths`: every rank's size along `dim`
    when already known (else one small all_gather asks the group). Not differentiable."""
    world = ds_comm.get_world_size(group)
    lengths = _gather_sizes(x, dim, group, world, lengths)
    longest = max(lengths)
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    ds_comm.all_gather(parts, x.contiguous(), group=group)
    return [part.narrow(dim, 0, n) for part, n in zip(parts, lengths)]


def single_all_to_all(input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int = 0, group: Any = None,
                      async_op: bool = False, handle: Any = None, type: Any = None,
                      gather_sizes: Optional[Sequence[int]] = None) -> Tensor:
    """One (non-differentiable) exchange: scatter `scatter_idx`, gather `gather_idx` (upstream's name).

    `batch_dim_idx` is accepted for upstream's signature: the layout follows from the two indices.
    `gather_sizes`: each rank's length of the gathered dim (they differ for uneven heads coming back);
    when not given the group is asked. Runs synchronously (`async_op` must be False)."""
    if async_op:
        raise ValueError("single_all_to_all: async_op=True is not supported; the exchange runs synchronously")
    world = ds_comm.get_world_size(group)
    return _exchange(input, scatter_idx, gather_idx, group, shard_sizes(input.shape[scatter_idx], world),
                     _gather_sizes(input, gather_idx, group, world, gather_sizes))


class _SeqAllToAll(torch.autograd.Function):
    """Differentiable exchange (upstream's name and argument order); backward runs the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int = 0,
                stream: Any = None, handle: Any = None, type: Any = None, is_fwd: bool = True,
                gather_sizes: Optional[Sequence[int]] = None) -> Tensor:
        world = ds_comm.get_world_size(group)
        scatter_sizes = shard_sizes(input.shape[scatter_idx], world)
        gather_sizes = _gather_sizes(input, gather_idx, group, world, gather_sizes)
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        ctx.scatter_sizes, ctx.gather_sizes = scatter_sizes, gather_sizes
        return _exchange(input, scatter_idx, gather_idx, group, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        grad_in = _exchange(grad.contiguous(), ctx.gather_idx, ctx.scatter_idx, ctx.group, ctx.gather_sizes,
                            ctx.scatter_sizes)
        return (None, grad_in) + (None, ) * 8


class _DimZeroAllToAll(torch.autograd.Function):
    """Differentiable all-to-all over dim 0, whose size must be the group's world size: row j goes to
    rank j, row j of the result came from rank j (upstream's name; ALST's building block)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:
        world = ds_comm.get_world_size(group)
        if input.shape[0] != world:
            raise ValueError(f"_DimZeroAllToAll: dim 0 is {input.shape[0]}, expected the group's world size {world}")
        ctx.group = group
        output = torch.empty_like(input, memory_format=torch.contiguous_format)
        ds_comm.all_to_all_single(output, input.contiguous(), group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return None, _DimZeroAllToAll.apply(ctx.group, grad)


class DistributedAttention(Module):
    """Wrap a local attention so it runs on sequence shards (Megatron-DeepSpeed's Ulysses form).

    `local_attention(q, k, v, *args, **kwargs)` sees every token of `H/P` heads. Inputs are sequence
    shards in the layout the indices name: `scatter_idx` is the heads dim, `gather_idx` the sequence dim
    (defaults `2, 0`: `[s/P, b, H, d]`; batch-first `[b, s/P, H, d]` is `gather_idx=1`). Keys/values may
    have fewer heads than queries (GQA) as long as each count splits over the group the same way the
    local attention expects. The output returns to sequence shards, `[s/P, b, H, d]` (or the local
    attention's `[s, b, H/P * d]` flattened likewise)."""

    def __init__(self, local_attention: Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        # Accepted for upstream's signature. Overlap of the q/k exchanges with compute is a CUDA-stream
        # optimisation; here every exchange runs on the current stream (same results).
        self.sp_stream = sp_stream

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: Optional[int] = None,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> Tensor:
        if rotary_pos_emb is not None:
            raise ValueError("DistributedAttention: rotary_pos_emb is not supported here; apply rotary embeddings "
                             "to q and k (with their global positions) before calling")
        world = ds_comm.get_world_size(self.spg)
        heads, kv_heads = query.shape[self.scatter_idx], key.shape[self.scatter_idx]
        if kv_heads != heads and (heads % world or kv_heads % world):
            raise ValueError(f"DistributedAttention: with {kv_heads} key/value heads for {heads} query heads (GQA) "
                             f"both counts must be divisible by the sequence-parallel size {world}; replicate the "
                             "key/value heads first")
        # every rank holds the same number of tokens (upstream's rule)
        seq_sizes = [query.shape[self.gather_idx]] * world
        q, k, v = (_SeqAllToAll.apply(self.spg, t, self.scatter_idx, self.gather_idx, batch_dim_idx, None, None, None,
                                      True, seq_sizes) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        # back: scatter the sequence, gather the heads (each rank's head count, uneven ones included)
        head_sizes = shard_sizes(heads, world)
        if context.dim() == query.dim():
            return _SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx, batch_dim_idx, None, None,
                                      None, True, head_sizes)
        # a local attention that flattened heads into the last dim: gather along it
        last = context.dim() - 1
        width = context.shape[last] // head_sizes[ds_comm.get_rank(self.spg)]
        return _SeqAllToAll.apply(self.spg, context, self.gather_idx, last, batch_dim_idx, None, None, None, True,
                                  [h * width for h in head_sizes])
