"""Muon on tensor-parallel slices: every matrix orthogonalised whole.

[Note: Muon under tensor parallelism]
Under AutoTP a rank holds a slice of a column- or row-parallel weight (a fused weight: a piece of
each block). Newton-Schulz of a slice is not Muon's update of the matrix (upstream 0.19.8 runs it
that way and matches neither whole-matrix nor per-shard Muon), so the direction of a sliced
matrix (momentum and Nesterov are elementwise, computed on the slice) is all-gathered over the
tensor group, joined by the layer's own rule, orthogonalised whole, and each rank keeps its slice
of the result. Every tensor peer reaches the same matrices in the same order (their plans are
the same: equal slices, the same ZeRO owners), so the gathers pair up. Cost per step: one
all-gather of each sliced Muon matrix in the NS compute dtype, (tp-1)/tp of it received per rank,
and every tensor peer runs NS on the whole matrix (tp times the FLOPs of one NS).
"""

from __future__ import annotations

from typing import Any

import torch

from .... import comm as ds_comm
from .original_muon import orthogonalize


def sliced_layout(param: Any) -> tuple[Any, int] | None:
    """(the AutoTP layer holding `param`'s slices, the dim they split) when `param` is a slice of
    a matrix over more than one tensor rank, else None. The layer hangs its `gather_params` on
    each of its sharded parameters (module_inject/layers.py), which is how it is found."""
    layer = getattr(getattr(param, "gather_params", None), "__self__", None)
    if layer is None or getattr(layer, "tp_world_size", 1) <= 1:
        return None
    for p, dim in layer.sharded_params():
        if p is param:
            return layer, dim
    return None


def orthogonalize_slice(direction: torch.Tensor, local_shape: torch.Size, layout: tuple[Any, int], ns_method: str,
                        head_dim: int | None = None) -> torch.Tensor:
    """NS of the whole matrix whose slice `direction` is (flat, `local_shape`), returned as this
    rank's slice of the result, flat (collective over the layer's tensor group). With `head_dim`
    (per-head Muon), the whole matrix's rows are cut into heads of that many rows."""
    layer, dim = layout
    local = direction.reshape(local_shape).contiguous()
    slices = [torch.empty_like(local) for _ in range(layer.tp_world_size)]
    ds_comm.all_gather(slices, local, group=layer.mp_group)
    whole = layer.join(slices, dim)
    heads = whole.shape[0] // head_dim if head_dim and whole.shape[0] % head_dim == 0 else None
    update = orthogonalize(whole.reshape(-1), whole.shape, ns_method, num_heads=heads)
    return layer._slice(update.reshape(whole.shape), dim).reshape(-1)


def orthogonalize_param(param: Any, direction: torch.Tensor, shape: torch.Size, ns_method: str) -> torch.Tensor:
    """`orthogonalize` for model parameter `param` (its local `shape`): whole-matrix NS when it
    is a tensor-parallel slice, else the plain call. Per-head Muon on a column slice of whole heads
    needs no gather: NS per head of the slice is the matching blocks of NS per head of the whole."""
    heads = getattr(param, "muon_num_heads", None)
    layout = sliced_layout(param)
    if layout is None or (heads is not None and layout[1] == 0):
        return orthogonalize(direction, shape, ns_method, num_heads=heads)
    return orthogonalize_slice(direction, shape, layout, ns_method, getattr(param, "muon_head_dim", None))
