"""The affine maps ([Note: affine maps] in affine.py) of tensor-parallel parameters: the one rule that
describes a tensor-parallel layout (`split_map`: even, or by recorded per-rank widths), the maps a checkpoint
records (`recorded_map`, under `universal_checkpoint_info["affine_map"]`), the layout upstream's pattern lists
give with each rank's slice shape (`pattern_layout`; `sub_param_blocks` reads their fused `shape` entries), and
the saved layout of a parameter whichever way the checkpoint describes it (`saved_map`: its recorded map, else
derived from the partition dim and fused blocks it records in `tp_partition_dims` / `tp_sub_param_sizes`, or
that upstream's pattern lists give). Pure.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from .affine import (AFFINE_MAP_FORMAT_VERSION, ParamAffineMap, contiguous_split_map, replicated_map,
                     sub_param_map)
from .constants import (AFFINE_MAP, AFFINE_MAP_PARAMS, AFFINE_MAP_VERSION, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                        PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS, TP_REPLICATED_PARAMETER_PATTERNS,
                        UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY)
from .files import CheckpointError


def split_map(full_shape: Sequence[int], dim: int | None, blocks: Sequence[int] | None, tp: int,
              widths: Sequence | None = None, name: str = "a parameter") -> ParamAffineMap:
    """AutoTP's layout of a parameter over `tp` ranks: whole on each rank (`dim` None), split along `dim`, or,
    fused (`blocks`: the sub-parameters' sizes along `dim`), each block split on its own
    (TensorParallel_Layer._slice). `widths` are the recorded per-rank widths when the split is uneven: each
    rank's width (plain), or per block each rank's width (fused; a rank may own none of a block, e.g. more
    ranks than key/value heads). Without them the split is even, and a size that does not divide is refused,
    naming `name`: an even guess would shift every later offset."""
    shape = tuple(int(s) for s in full_shape)
    if dim is None:
        return replicated_map(shape, tp)
    blocks = [int(b) for b in blocks] if blocks else [shape[dim]]
    if sum(blocks) != shape[dim]:
        raise CheckpointError(f"{name}: fused blocks {blocks} do not add up to the partitioned dim {dim} of {shape}")
    fused = len(blocks) > 1 or (widths is not None and len(widths) and isinstance(widths[0], (list, tuple)))
    if widths is None:
        uneven = [b for b in blocks if b % tp]
        if uneven:
            recorded = "sub_param_shard_widths" if fused else "partition_sizes"
            raise CheckpointError(f"{name}: {'sub-parameter sizes' if fused else f'dim {dim} of size'} "
                                  f"{uneven if fused else uneven[0]} not divisible by tp_world_size {tp}, and the "
                                  f"checkpoint records no {recorded} for it, so its uneven layout cannot be rebuilt")
        widths = [[b // tp] * tp for b in blocks]
    elif not fused:
        widths = [list(widths)]
    widths = [[int(w) for w in row] for row in widths]
    if len(widths) != len(blocks) or any(len(row) != tp or sum(row) != b for row, b in zip(widths, blocks)):
        raise CheckpointError(f"{name}: per-rank widths {widths} do not split blocks {blocks} of dim {dim} over "
                              f"{tp} tensor ranks")
    if len(blocks) == 1:
        return contiguous_split_map(shape, widths[0], dim)
    return sub_param_map(shape, blocks, widths, dim)


def sub_param_blocks(spec, full_size: int, name: str = "a parameter") -> list[int]:
    """A fused parameter's block sizes along its partition dim from upstream's `shape` entry at that dim: the
    sizes (a tuple), or, in metadata before version 0.4 (e.g. `shape` (3, -1) for q/k/v), the count of equal
    blocks, which taken for a size would join three rows instead of the whole parameter."""
    if isinstance(spec, (tuple, list)):
        blocks = [int(b) for b in spec]
    else:
        count = int(spec)
        if count <= 0 or full_size % count:
            raise CheckpointError(f"{name}: a sub-parameter count of {count} does not divide its partitioned dim "
                                  f"of {full_size}")
        blocks = [full_size // count] * count
    if sum(blocks) != full_size:
        raise CheckpointError(f"{name}: sub-parameter sizes {blocks} add up to {sum(blocks)}, not its partitioned "
                              f"dim of {full_size}")
    return blocks


def pattern_layout(info: Mapping, name: str, slice_shapes: Sequence[Sequence[int]]
                   ) -> tuple[ParamAffineMap, int | None, list[int] | None, str | None]:
    """How a checkpoint described by upstream's pattern lists (`universal_checkpoint_info` without an affine
    map for `name`) holds `name`, given each tensor rank's slice shape: (map, partition dim or None when
    TP-replicated, fused block sizes or None, the sub-parameter pattern matched or None). Row-parallel
    parameters are split on dim 1, fused ones on their `partition_dim` by `sub_param_shard_widths` (required
    from version 0.4 on; before, an even split), every other one on dim 0; each rank's width of a plain split
    is its slice's, so uneven splits join exactly."""
    shapes = [tuple(int(d) for d in s) for s in slice_shapes]
    tp = len(shapes)
    hit = lambda patterns: next((p for p in patterns or [] if re.match(p, name)), None)   # noqa: E731
    if hit(info.get(TP_REPLICATED_PARAMETER_PATTERNS)):
        return replicated_map(shapes[0], tp), None, None, None

    def whole(dim: int) -> list[int]:
        if any(len(s) <= dim or s[:dim] + s[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:] for s in shapes):
            raise CheckpointError(f"{name}: the tensor ranks' slices {shapes} do not differ only along dim {dim}")
        return [sum(s[dim] for s in shapes) if d == dim else n for d, n in enumerate(shapes[0])]

    for sub in info.get(PARAMETER_WITH_SUB_PARAMS) or []:
        sub = sub if isinstance(sub, Mapping) else vars(sub)
        pattern = hit(sub.get("patterns"))
        if pattern is None:
            continue
        dim = int(sub["partition_dim"])
        full = whole(dim)
        blocks = sub_param_blocks(list(sub["shape"])[dim], full[dim], name)
        widths = (info.get(SUB_PARAM_SHARD_WIDTHS) or {}).get(pattern)
        version = float(info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
        if widths is None and version >= 0.4:
            raise CheckpointError(f"{name}: universal checkpoint version {version} records no sub_param_shard_widths "
                                  f"for {pattern!r}, which declares sub-parameters {blocks}")
        return split_map(full, dim, blocks, tp, widths, name), dim, blocks, pattern
    dim = 1 if hit(info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS)) else 0
    return split_map(whole(dim), dim, None, tp, [s[dim] for s in shapes], name), dim, None, None


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
