"""Where each tensor-parallel shard of a parameter sits in the whole tensor, at upstream's path and in its
encoding (DeepSpeed 0.19.8's `deepspeed.checkpoint.affine`: the same names, the same dict), plus the pure
re-slice plan between two such descriptions (`plan`), which upstream does not have.

[Note: affine maps]
A `ParamAffineMap` says, for every rank of a tensor-parallel group, which elements of the whole parameter
its shard holds and where: a list of `AffinePiece`s, each one block of elements described twice with
`torch.as_strided` arguments (shape, offset, strides), once in the whole tensor (`source`) and once in the
rank's shard (`dest`), plus the ranks holding that same block (`locations`: more than one when it is
replicated) and the factor the shard holds it by (`scale`: shard == whole * scale). The geometry alone
rebuilds the whole tensor (`rebuild`) and cuts a shard out of it (`extract`), so a converter needs no
category ("row-parallel", "vocabulary", "fused") and no name rule. A piece never averages elements: the
description stays invertible.

`plan(saved, running, rank)` is a TP re-slice computed from two maps: for the running rank's shard, which
saved rank's shard holds each of its blocks and where (box intersections). It handles pieces that are
blocks (boxes) of both tensors, which is every layout the builders below make; a general strided piece
is refused by name.

Stored form (`to_dict`, plain ints/floats/lists, readable without torch):
`{"logical_shape": [..], "ranks": {rank: {"shard_shape": [..], "pieces": [{"shape": [..],
"source": [offset, [strides]], "dest": [offset, [strides]], "locations": [ranks], "scale": s (only when not
1)}]}}}`; a model publishes its maps under `universal_checkpoint_info["affine_map"] = {"version": 1,
"params": {name pattern: map}}` (`AFFINE_MAP_FORMAT_VERSION`; a newer version is refused, not guessed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

__all__ = ["AffinePiece", "ParamAffineMap", "AFFINE_MAP_FORMAT_VERSION", "SCALE_POWER_BY_STATE", "replicated_map",
           "contiguous_split_map", "sub_param_map", "segmented_map", "block_gather_map", "PlanPiece", "plan"]

AFFINE_MAP_FORMAT_VERSION = 1

# The power a piece's scale enters each stored state with: scaling a parameter by s scales its gradient by
# 1/s, so Adam's first moment carries s**-1 and its second moment s**-2.
SCALE_POWER_BY_STATE = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}


def _dense(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class AffinePiece:
    """One block of elements: `shape`, its place in the whole tensor (`source_offset`, `source_strides`) and in
    the shard (`dest_offset`, `dest_strides`), the ranks holding it, and the scale the shard holds it by. A
    piece is homogeneous: every element it covers has the same holders and scale."""

    __slots__ = ("shape", "source_offset", "source_strides", "dest_offset", "dest_strides", "locations", "scale")

    def __init__(self, shape: Sequence[int], source_offset: int, source_strides: Sequence[int], dest_offset: int,
                 dest_strides: Sequence[int], locations: Iterable[int], scale: float = 1.0) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.source_offset, self.dest_offset = int(source_offset), int(dest_offset)
        self.source_strides = tuple(int(s) for s in source_strides)
        self.dest_strides = tuple(int(s) for s in dest_strides)
        self.locations = frozenset(int(r) for r in locations)
        self.scale = float(scale)
        if self.scale == 0.0:
            raise ValueError("AffinePiece: scale 0 is not invertible (the whole tensor could not be rebuilt); "
                             "use any non-zero factor")
        if len(self.source_strides) != len(self.shape) or len(self.dest_strides) != len(self.shape):
            raise ValueError(f"AffinePiece: shape {self.shape} needs one source and one dest stride per dim, got "
                             f"{self.source_strides} and {self.dest_strides}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def source_view(self, full_param: torch.Tensor) -> torch.Tensor:
        """The piece's elements as a view of the (flat, offset-0) whole tensor."""
        return torch.as_strided(full_param, self.shape, self.source_strides, self.source_offset)

    def dest_view(self, shard: torch.Tensor) -> torch.Tensor:
        """The piece's elements as a view of the (flat, offset-0) shard."""
        return torch.as_strided(shard, self.shape, self.dest_strides, self.dest_offset)

    def source_offsets(self) -> Iterator[int]:
        """The whole-tensor offset of every element covered (O(numel): for checks and tests)."""
        if self.numel == 0:
            return
        for index in _indices(self.shape):
            yield self.source_offset + sum(i * s for i, s in zip(index, self.source_strides))

    def _key(self) -> tuple:
        return (self.shape, self.source_offset, self.source_strides, self.dest_offset, self.dest_strides,
                self.locations, self.scale)

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, AffinePiece) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"AffinePiece(shape={self.shape}, source=({self.source_offset}, {self.source_strides}), "
                f"dest=({self.dest_offset}, {self.dest_strides}), locations={sorted(self.locations)}, "
                f"scale={self.scale})")


def _indices(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for tail in _indices(shape[1:]):
            yield (head, *tail)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat tensor whose storage starts at its first element (piece offsets are storage offsets)."""
    flat = tensor.reshape(-1)
    return flat if flat.storage_offset() == 0 else flat.clone()


class ParamAffineMap:
    """One parameter over a tensor-parallel group ([Note: affine maps]): the whole shape, each rank's shard
    shape and each rank's pieces."""

    def __init__(self, logical_shape: Sequence[int], shard_shapes: Mapping[Any, Sequence[int]],
                 pieces_by_rank: Mapping[Any, Iterable[AffinePiece]]) -> None:
        self.logical_shape = tuple(int(s) for s in logical_shape)
        self.shard_shapes = {int(r): tuple(int(s) for s in shape) for r, shape in shard_shapes.items()}
        self.pieces_by_rank = {int(r): list(pieces) for r, pieces in pieces_by_rank.items()}

    @property
    def numel(self) -> int:
        return math.prod(self.logical_shape)

    def holders(self) -> dict[int, set[int]]:
        """{whole-tensor offset: ranks whose pieces hold it} (O(numel))."""
        out: dict[int, set[int]] = {}
        for rank, pieces in self.pieces_by_rank.items():
            for piece in pieces:
                for offset in piece.source_offsets():
                    out.setdefault(offset, set()).add(rank)
        return out

    def uncovered_offsets(self) -> list[int]:
        """Offsets of the whole tensor no rank holds (non-empty: the parameter cannot be rebuilt)."""
        held = self.holders()
        return [o for o in range(self.numel) if o not in held]

    def validate(self) -> None:
        """Cheap checks: each rank's pieces account for its shard's elements, and dense pieces stay inside the
        shard without writing an address twice."""
        for rank, pieces in self.pieces_by_rank.items():
            if rank not in self.shard_shapes:
                raise ValueError(f"affine map: rank {rank} has pieces but no shard_shape")
            size = math.prod(self.shard_shapes[rank])
            held = sum(p.numel for p in pieces)
            if held != size:
                raise ValueError(f"affine map: rank {rank}'s shard {self.shard_shapes[rank]} has {size} elements "
                                 f"but its pieces cover {held}")
            spans = sorted(s for s in (_dense_span(p) for p in pieces) if s is not None)
            end = 0
            for start, stop in spans:
                if start < end or stop > size:
                    raise ValueError(f"affine map: rank {rank}'s pieces write shard elements [{start}, {stop}) "
                                     f"outside its {size} elements or over another piece")
                end = stop

    def validate_coverage(self) -> None:
        """The full (O(numel)) check: `validate`, every element held, and every piece's `locations` exactly
        the ranks holding its elements."""
        self.validate()
        missing = self.uncovered_offsets()
        if missing:
            raise ValueError(f"affine map of shape {self.logical_shape}: {len(missing)} element(s) held by no rank, "
                             f"the first at offset {missing[0]}")
        held = self.holders()
        for rank, pieces in self.pieces_by_rank.items():
            for piece in pieces:
                for offset in piece.source_offsets():
                    if held[offset] != piece.locations:
                        raise ValueError(f"affine map: {piece} on rank {rank} names locations "
                                         f"{sorted(piece.locations)}, but offset {offset} is held by "
                                         f"{sorted(held[offset])}")

    def _refuse_scaled_state(self, scale_power: int) -> None:
        """Optimizer moments would convert under their powers, but the optimizer's lr/eps stay in the saved
        coordinate, so a resumed run would silently diverge (upstream refuses it the same way)."""
        if scale_power != 1 and any(p.scale != 1.0 for ps in self.pieces_by_rank.values() for p in ps):
            raise NotImplementedError("affine map: moving an optimizer state (scale_power "
                                      f"{scale_power}) through a scaled piece is not supported")

    def rebuild(self, shards: Mapping[Any, torch.Tensor], scale_power: int = 1) -> torch.Tensor:
        """The whole parameter from `shards` ({rank: shard}). Ranks of replicated pieces may be left out as
        long as every element is held by a given shard; replicas that are given must agree."""
        self.validate()
        self._refuse_scaled_state(scale_power)
        shards = {int(r): s for r, s in shards.items()}
        unknown = sorted(set(shards) - set(self.shard_shapes))
        if unknown:
            raise ValueError(f"affine map: shards of ranks {unknown} given; the map has ranks "
                             f"{sorted(self.shard_shapes)}")
        for rank, shard in shards.items():
            if shard.numel() != math.prod(self.shard_shapes[rank]):
                raise ValueError(f"affine map: rank {rank}'s shard has {shard.numel()} elements, the map says "
                                 f"{self.shard_shapes[rank]}")
        first = next(iter(shards.values()))
        whole = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        done: dict[tuple, int] = {}
        for rank in sorted(shards):
            flat = _flat(shards[rank])
            for piece in self.pieces_by_rank.get(rank, []):
                value = piece.dest_view(flat)
                factor = piece.scale ** scale_power
                value = value / factor if factor != 1.0 else value
                key = (piece.source_offset, piece.shape, piece.source_strides)
                if key in done:
                    if not torch.equal(piece.source_view(whole), value):
                        raise ValueError(f"affine map: ranks {done[key]} and {rank} hold different values for the "
                                         f"replicated block at offset {piece.source_offset} of shape {piece.shape}")
                    continue
                piece.source_view(whole).copy_(value)
                done[key] = rank
        written = sum(math.prod(k[1]) for k in done)
        if written < self.numel:
            absent = sorted(set(self.shard_shapes) - set(shards))
            raise ValueError(f"affine map: the given shards cover {written} of {self.numel} elements of "
                             f"{self.logical_shape}; ranks not given: {absent}")
        return whole.view(self.logical_shape)

    def extract(self, full_param: torch.Tensor, rank: int, scale_power: int = 1) -> torch.Tensor:
        """Rank `rank`'s shard cut from the whole parameter (the inverse of `rebuild`)."""
        self._refuse_scaled_state(scale_power)
        if tuple(full_param.shape) != self.logical_shape and full_param.numel() != self.numel:
            raise ValueError(f"affine map: a tensor of shape {tuple(full_param.shape)} is not the whole "
                             f"{self.logical_shape}")
        whole = _flat(full_param)
        shape = self.shard_shapes[int(rank)]
        shard = torch.empty(math.prod(shape), dtype=full_param.dtype, device=full_param.device)
        for piece in self.pieces_by_rank[int(rank)]:
            target = piece.dest_view(shard)
            target.copy_(piece.source_view(whole))
            if piece.scale ** scale_power != 1.0:
                target.mul_(piece.scale ** scale_power)
        return shard.view(shape)

    def to_dict(self) -> dict:
        return {"logical_shape": list(self.logical_shape),
                "ranks": {rank: {"shard_shape": list(self.shard_shapes[rank]),
                                 "pieces": [_piece_dict(p) for p in self.pieces_by_rank[rank]]}
                          for rank in sorted(self.pieces_by_rank)}}

    @classmethod
    def from_dict(cls, entry: Mapping) -> "ParamAffineMap":
        try:
            ranks = entry["ranks"]
            return cls(entry["logical_shape"], {r: v["shard_shape"] for r, v in ranks.items()},
                       {r: [_piece_from_dict(p) for p in v["pieces"]] for r, v in ranks.items()})
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not an affine map entry (want logical_shape and ranks: {{rank: {{shard_shape, "
                             f"pieces}}}}): {error!r}") from error

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParamAffineMap):
            return NotImplemented
        return (self.logical_shape, self.shard_shapes, self.pieces_by_rank) == \
            (other.logical_shape, other.shard_shapes, other.pieces_by_rank)

    def __repr__(self) -> str:
        counts = {r: len(p) for r, p in sorted(self.pieces_by_rank.items())}
        return f"ParamAffineMap(logical_shape={self.logical_shape}, pieces_per_rank={counts})"


def _dense_span(piece: AffinePiece) -> tuple[int, int] | None:
    """[start, stop) of a piece that is one contiguous run of its shard; None for a strided or empty one."""
    dense = _dense(piece.shape)
    if piece.numel == 0 or any(n > 1 and s != d for n, s, d in zip(piece.shape, piece.dest_strides, dense)):
        return None
    return piece.dest_offset, piece.dest_offset + piece.numel


def _piece_dict(piece: AffinePiece) -> dict:
    out = {"shape": list(piece.shape), "source": [piece.source_offset, list(piece.source_strides)],
           "dest": [piece.dest_offset, list(piece.dest_strides)], "locations": sorted(piece.locations)}
    if piece.scale != 1.0:   # upstream leaves the default out
        out["scale"] = piece.scale
    return out


def _piece_from_dict(entry: Mapping) -> AffinePiece:
    (src, src_strides), (dst, dst_strides) = entry["source"], entry["dest"]
    return AffinePiece(entry["shape"], src, src_strides, dst, dst_strides, entry["locations"], entry.get("scale", 1.0))


# --- builders: each rank's shard is a run of blocks along one dim, placed one after another --------------


def _runs_map(shape: Sequence[int], dim: int, runs_by_rank: Mapping[int, list[tuple[int, int, Iterable[int]]]]
              ) -> ParamAffineMap:
    """Rank r's shard: its runs (start along `dim`, width, holders) of the whole tensor, back to back along
    `dim` (a zero-width run is kept as an empty piece, as upstream's builders keep it)."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"partition_dim {dim} is not a dim of shape {shape}")
    src_strides = _dense(shape)
    shard_shapes, pieces_by_rank = {}, {}
    for rank, runs in runs_by_rank.items():
        runs = [(int(a), int(w), list(h)) for a, w, h in runs]
        shard = shape[:dim] + (sum(w for _, w, _ in runs),) + shape[dim + 1:]
        dst_strides, placed, pieces = _dense(shard), 0, []
        for start, width, holders in runs:
            if start < 0 or width < 0 or start + width > shape[dim]:
                raise ValueError(f"a block [{start}, {start + width}) outside dim {dim} of size {shape[dim]}")
            pieces.append(AffinePiece(shape[:dim] + (width,) + shape[dim + 1:], start * src_strides[dim], src_strides,
                                      placed * dst_strides[dim], dst_strides, holders))
            placed += width
        shard_shapes[rank], pieces_by_rank[rank] = shard, pieces
    return ParamAffineMap(shape, shard_shapes, pieces_by_rank)


def replicated_map(shape: Sequence[int], tp_degree: int, scale: float = 1.0) -> ParamAffineMap:
    """Every rank holds the whole parameter (times `scale`: a row layer's bias pre-divided by the group size
    is the use upstream names)."""
    shape, ranks = tuple(int(s) for s in shape), list(range(int(tp_degree)))
    piece = AffinePiece(shape, 0, _dense(shape), 0, _dense(shape), ranks, scale)
    return ParamAffineMap(shape, {r: shape for r in ranks}, {r: [piece] for r in ranks})


def contiguous_split_map(shape: Sequence[int], per_rank_sizes: Sequence[int], partition_dim: int) -> ParamAffineMap:
    """Rank r holds one contiguous block of `per_rank_sizes[r]` along `partition_dim` (uneven allowed)."""
    starts = [sum(per_rank_sizes[:r]) for r in range(len(per_rank_sizes))]
    if sum(per_rank_sizes) != tuple(shape)[partition_dim]:
        raise ValueError(f"per_rank_sizes {list(per_rank_sizes)} do not add up to dim {partition_dim} of "
                         f"{tuple(shape)}")
    return _runs_map(shape, partition_dim, {r: [(starts[r], w, [r])] for r, w in enumerate(per_rank_sizes)})


def sub_param_map(shape: Sequence[int], sub_dim_sizes: Sequence[int], shard_widths: Sequence[Sequence[int]],
                  partition_dim: int) -> ParamAffineMap:
    """A fused parameter (q/k/v, gate/up): sub-parameters of `sub_dim_sizes` back to back along
    `partition_dim`, each split on its own (`shard_widths[i][r]`: rank r's width of sub-parameter i); a
    rank's shard is its piece of each sub-parameter in turn."""
    if len(sub_dim_sizes) != len(shard_widths) or any(sum(w) != s for s, w in zip(sub_dim_sizes, shard_widths)):
        raise ValueError(f"shard_widths {[list(w) for w in shard_widths]} do not split sub_dim_sizes "
                         f"{list(sub_dim_sizes)}")
    tp = len(shard_widths[0])
    runs: dict[int, list] = {r: [] for r in range(tp)}
    base = 0
    for size, widths in zip(sub_dim_sizes, shard_widths):
        for r in range(tp):
            runs[r].append((base + sum(widths[:r]), widths[r], [r]))
        base += size
    return _runs_map(shape, partition_dim, runs)


def segmented_map(shape: Sequence[int], segments: Sequence[tuple[int, bool]], partition_dim: int, tp_degree: int,
                  split_widths: Sequence[Sequence[int]]) -> ParamAffineMap:
    """Segments `(size, replicated)` along `partition_dim`: a replicated one whole on every rank, a split one
    cut by the next entry of `split_widths` (e.g. query rows split, the shared key/value rows replicated)."""
    widths = iter(split_widths)
    runs: dict[int, list] = {r: [] for r in range(tp_degree)}
    base = 0
    for size, replicated in segments:
        if replicated:
            for r in range(tp_degree):
                runs[r].append((base, size, range(tp_degree)))
        else:
            split = list(next(widths))
            if len(split) != tp_degree or sum(split) != size:
                raise ValueError(f"split widths {split} do not cut a segment of {size} over {tp_degree} ranks")
            for r in range(tp_degree):
                runs[r].append((base + sum(split[:r]), split[r], [r]))
        base += size
    return _runs_map(shape, partition_dim, runs)


def block_gather_map(shape: Sequence[int], block_ids_by_rank: Mapping[int, Sequence[int]], block_size: int,
                     partition_dim: int) -> ParamAffineMap:
    """Rank r holds the blocks `block_ids_by_rank[r]` (each `block_size` along `partition_dim`), in that order;
    consecutive ids make one piece."""
    runs: dict[int, list] = {}
    for rank, ids in block_ids_by_rank.items():
        out: list = []
        for i in ids:
            if out and out[-1][0] + out[-1][1] == i * block_size:
                out[-1] = (out[-1][0], out[-1][1] + block_size, [rank])
            else:
                out.append((i * block_size, block_size, [rank]))
        runs[rank] = out
    return _runs_map(shape, partition_dim, runs)


# --- the re-slice plan between two maps ---------------------------------------------------------------


@dataclass(frozen=True)
class PlanPiece:
    """A box of the running rank's new shard: `shape` elements at `dst` (start per dim in the new shard) come
    from saved rank `saved_rank`'s shard at `src` (start per dim), times `scale` (the new piece's scale over
    the saved one's; 1 unless a layout pre-scales)."""
    saved_rank: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    shape: tuple[int, ...]
    scale: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _box(piece: AffinePiece, offset: int, strides: Sequence[int], within: Sequence[int], side: str) -> tuple[int, ...]:
    """The start (per dim) of `piece` as a box of a tensor of shape `within`; refused when the piece is not
    one (strided differently from that tensor's row-major layout, or of another rank)."""
    dense = _dense(within)
    if len(piece.shape) != len(within) or any(n > 1 and s != d for n, s, d in zip(piece.shape, strides, dense)):
        raise ValueError(f"plan: {piece} is not a block of the {side} tensor of shape {tuple(within)} (its strides "
                         f"are not that tensor's {dense}); only block pieces can be re-sliced")
    start = [(offset // d) % n if n else 0 for d, n in zip(dense, within)]
    if within:
        start[0] = offset // dense[0] if dense[0] else 0
    if any(a + n > m for a, n, m in zip(start, piece.shape, within)):
        raise ValueError(f"plan: {piece} runs past the {side} tensor of shape {tuple(within)}")
    return tuple(start)


def plan(saved_map: ParamAffineMap, running_map: ParamAffineMap, rank: int) -> list[PlanPiece]:
    """The pure plan of a TP re-slice: for running rank `rank`'s shard, each box of it and the saved rank's
    shard (and place in it) that holds those elements, in the running pieces' order, then saved rank order.
    A replicated saved block is read from the lowest rank holding it. Raises ValueError when the two maps
    describe different tensors, a piece is not a block, or the saved shards miss an element."""
    shape = saved_map.logical_shape
    if running_map.logical_shape != shape:
        raise ValueError(f"plan: the saved map is of a tensor of shape {shape}, the running one of "
                         f"{running_map.logical_shape}")
    if int(rank) not in running_map.pieces_by_rank:
        raise ValueError(f"plan: rank {rank} is not in the running map (ranks {sorted(running_map.pieces_by_rank)})")
    saved = [(r, q, _box(q, q.source_offset, q.source_strides, shape, "whole"),
              _box(q, q.dest_offset, q.dest_strides, saved_map.shard_shapes[r], f"saved rank {r}'s shard"))
             for r in sorted(saved_map.pieces_by_rank) for q in saved_map.pieces_by_rank[r]
             if q.numel and r == min(q.locations | {r})]
    out, want = [], 0
    new_shard = running_map.shard_shapes[int(rank)]
    for p in running_map.pieces_by_rank[int(rank)]:
        if not p.numel:
            continue
        want += p.numel
        whole = _box(p, p.source_offset, p.source_strides, shape, "whole")
        place = _box(p, p.dest_offset, p.dest_strides, new_shard, "running shard")
        for r, q, q_whole, q_place in saved:
            lo = [max(a, b) for a, b in zip(whole, q_whole)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(whole, p.shape, q_whole, q.shape)]
            if all(a < z for a, z in zip(lo, hi)):
                out.append(PlanPiece(r, tuple(s + a - b for s, a, b in zip(q_place, lo, q_whole)),
                                     tuple(s + a - b for s, a, b in zip(place, lo, whole)),
                                     tuple(z - a for a, z in zip(lo, hi)), p.scale / q.scale))
    got = sum(s.numel for s in out)
    if got != want:
        raise ValueError(f"plan: the saved shards of {shape} hold {got} of the {want} elements running rank "
                         f"{rank} needs (saved ranks {sorted(saved_map.pieces_by_rank)})")
    return out
