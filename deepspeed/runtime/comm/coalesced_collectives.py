# compat: upstream path deepspeed.runtime.comm.coalesced_collectives (DeepSpeed 0.19.8 names).
"""Several tensors reduce-scattered in one collective, as upstream's ZeRO-3 reducer does.

Each tensor is averaged over the group and cut into `world` equal chunks (the last ones shorter or
empty when it does not divide); rank r gets chunk r of every tensor. One flat buffer holds, for
each rank in turn, its padded chunk of every tensor, so a single reduce-scatter delivers them all.
Our own ZeRO-3 reduces through its bucketed reducer (zero/stage3/reducer.py); this is for code that
calls upstream's function directly."""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import comm as ds_comm


def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """This rank's chunk of the group mean of each tensor (views into one buffer)."""
    world, rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
    chunks = [math.ceil(t.numel() / world) for t in tensors]
    per_rank = sum(chunks)
    flat = tensors[0].new_zeros(per_rank * world)
    for r in range(world):
        offset = r * per_rank
        for t, size in zip(tensors, chunks):
            part = t.reshape(-1)[r * size:(r + 1) * size]
            flat[offset:offset + part.numel()].copy_(part)
            offset += size
    flat.div_(world)   # pre-divide, as upstream: the sum of the divided values is the mean
    mine = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
    ds_comm.reduce_scatter_tensor(mine, flat, group=group)
    outputs, offset = [], 0
    for t, size in zip(tensors, chunks):
        length = max(0, min(size, t.numel() - rank * size))
        outputs.append(mine.narrow(0, offset, length))
        offset += size
    return outputs


def all_to_all_quant_reduce(tensors: list[torch.Tensor], groups: Any = None) -> list[torch.Tensor]:
    """ZeRO++ qgZ's reduction under upstream's name: this rank's chunk of the group mean of each
    tensor, exchanged as block-wise int8 ([Note: qgZ quantized reduce-scatter] in zero/qgz.py).
    One level over the whole world: `groups` (upstream's intra/inter-node groups) is not used. 1-D
    tensors go through the unquantised `reduce_scatter_coalesced`, as upstream."""
    from ..zero.qgz import quantized_reduce_scatter

    world, rank = ds_comm.get_world_size(), ds_comm.get_rank()
    outputs = []
    for t in tensors:
        if t.dim() == 1:
            outputs.append(reduce_scatter_coalesced([t])[0])
            continue
        size = math.ceil(t.numel() / world)
        flat = torch.zeros(size * world, dtype=torch.float32, device=t.device)
        flat[:t.numel()].copy_(t.reshape(-1))
        mine = torch.empty(size, dtype=torch.float32, device=t.device)
        quantized_reduce_scatter(mine, flat, None, _QUANT_TIMEOUT_S)
        length = max(0, min(size, t.numel() - rank * size))
        outputs.append(mine[:length].div_(world).to(t.dtype))
    return outputs


_QUANT_TIMEOUT_S = 1800.0   # torch's default process-group timeout
