"""The affine maps ([Note: affine maps] in affine.py) of tensor-parallel parameters: the one rule that
describes our layers' layout (`split_map`), the maps a checkpoint records (`recorded_map`, under
`universal_checkpoint_info["affine_map"]`), and the saved layout of a parameter whichever way the checkpoint
describes it (`saved_map`: its recorded map, else derived from the partition dim and fused blocks it
records in `tp_partition_dims` / `tp_sub_param_sizes`, or that upstream's pattern lists give). Pure.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from .affine import (AFFINE_MAP_FORMAT_VERSION, ParamAffineMap, contiguous_split_map, replicated_map,
                     sub_param_map)
from .constants import AFFINE_MAP, AFFINE_MAP_PARAMS, AFFINE_MAP_VERSION, UNIVERSAL_CHECKPOINT_INFO
from .files import CheckpointError


def split_map(full_shape: Sequence[int], dim: int | None, blocks: Sequence[int] | None, tp: int) -> ParamAffineMap:
    """AutoTP's layout of a parameter over `tp` ranks: whole on each rank (`dim` None), an even split along
    `dim`, or, fused (`blocks`: the sub-parameters' sizes along `dim`), each block split evenly on its own
    (TensorParallel_Layer._slice). A size that does not divide is refused, naming it."""
    shape = tuple(int(s) for s in full_shape)
    if dim is None:
        return replicated_map(shape, tp)
    blocks = [int(b) for b in blocks] if blocks else [shape[dim]]
    if sum(blocks) != shape[dim]:
        raise CheckpointError(f"fused blocks {blocks} do not add up to the partitioned dim {dim} of {shape}")
    for b in blocks:
        if b % tp:
            raise CheckpointError(f"a partitioned dim (block) of {b} is not divisible by the tensor-parallel "
                                  f"size {tp}")
    if len(blocks) == 1:
        return contiguous_split_map(shape, [shape[dim] // tp] * tp, dim)
    return sub_param_map(shape, blocks, [[b // tp] * tp for b in blocks], dim)


def published(maps: Mapping[str, ParamAffineMap]) -> dict:
    """The `universal_checkpoint_info["affine_map"]` entry of `maps` ({name pattern: map}), upstream's encoding."""
    return {AFFINE_MAP_VERSION: AFFINE_MAP_FORMAT_VERSION, AFFINE_MAP_PARAMS: {p: m.to_dict() for p, m in maps.items()}}


def recorded_maps(states: Mapping) -> dict[str, dict]:
    """{name pattern: stored map} a model-states dict records (empty when none); a newer format is refused."""
    entry = ((states or {}).get(UNIVERSAL_CHECKPOINT_INFO) or {}).get(AFFINE_MAP) or {}
    version = entry.get(AFFINE_MAP_VERSION, AFFINE_MAP_FORMAT_VERSION)
    if version > AFFINE_MAP_FORMAT_VERSION:
        raise CheckpointError(f"the checkpoint's affine maps are format version {version}; this reader knows up to "
                              f"{AFFINE_MAP_FORMAT_VERSION}")
    return dict(entry.get(AFFINE_MAP_PARAMS) or {})


def recorded_map(states: Mapping, name: str, tp: int) -> ParamAffineMap | None:
    """The map a model-states dict records for parameter `name` (its patterns are regexes, as upstream's), checked
    to describe the checkpoint's `tp` tensor ranks."""
    maps = recorded_maps(states)
    hits = [p for p in maps if re.match(p, name)]
    if len(hits) > 1:
        raise CheckpointError(f"parameter {name!r} matches several affine-map patterns {hits}")
    if not hits:
        return None
    try:
        found = ParamAffineMap.from_dict(maps[hits[0]])
    except ValueError as error:
        raise CheckpointError(f"the affine map recorded for {name!r}: {error}") from error
    if sorted(found.shard_shapes) != list(range(tp)):
        raise CheckpointError(f"the affine map recorded for {name!r} describes tensor ranks "
                              f"{sorted(found.shard_shapes)}; the checkpoint holds {tp}")
    return found


def saved_map(states: Mapping, name: str, slice_shape: Sequence[int], saved_tp: int, dim: int | None,
              blocks: Sequence[int] | None) -> ParamAffineMap:
    """How the checkpoint holds `name` over its `saved_tp` tensor ranks (each slice of `slice_shape`): the map it
    records, else the AutoTP layout of partition `dim` and fused `blocks` (from `tp_partition_dims` /
    `tp_sub_param_sizes`, or upstream's pattern lists). At `saved_tp` 1 (also a universal checkpoint, whose
    model states keep the maps of the layout it was converted from) the slice is the whole tensor."""
    slice_shape = tuple(int(s) for s in slice_shape)
    if saved_tp == 1:
        return split_map(slice_shape, None, None, 1)
    found = recorded_map(states, name, saved_tp)
    if found is None:
        full = list(slice_shape)
        if dim is not None:
            full[dim] *= saved_tp
        return split_map(full, dim, blocks, saved_tp)
    if found.shard_shapes[0] != slice_shape:
        raise CheckpointError(f"the affine map recorded for {name!r} gives tensor rank 0 a slice of "
                              f"{found.shard_shapes[0]}; the checkpoint holds {slice_shape}")
    return found


def source_ranks(amap: ParamAffineMap) -> list[int]:
    """The ranks whose shards `rebuild` needs: each replicated block from its lowest holder."""
    return sorted({min(p.locations | {r}) for r, ps in amap.pieces_by_rank.items() for p in ps if p.numel})


def rebuild(amap: ParamAffineMap, name: str, shards: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """`amap.rebuild` of one stored field of `name`; a scaled piece is refused (a field's scale power depends
    on what the field is, and no layout of ours scales)."""
    if any(p.scale != 1.0 for ps in amap.pieces_by_rank.values() for p in ps):
        raise CheckpointError(f"the affine map of {name!r} has scaled pieces; joining scaled slices is not supported")
    try:
        return amap.rebuild(shards)
    except ValueError as error:
        raise CheckpointError(f"{name!r}: {error}") from error
