"""What a checkpoint's optimizer-state files hold, at the data-parallel level: [Note: a checkpoint describes itself].

[Note: a checkpoint describes itself]
Each saved rank's optimizer-state file holds flats: 1-D tensors (the fp32 masters and one per optimizer
state) in which runs of elements are pieces ("fragments") of parameters. A `Description` says, for one
tag's file set, which: the partition kind ("flat": each param group flattened in order and padded to a
multiple of `alignment` x N, cut in N equal shards, DeepSpeed's ZeRO-1/2 and stage-0 bf16 layout;
"paramwise": every parameter cut on its own in N pieces of ceil(numel/N), DeepSpeed's ZeRO-3 layout,
whose per-group flats a reader joins into one), the saved rank count N, the alignment and each param
group's parameter order and shapes. It is pure and compact: one `BucketPartition` / `ParamwisePartition`
per group (runtime/zero/partition.py, the same objects the writer cuts the files with), so it holds
O(params + groups) numbers whatever N; a rank's `fragments` are computed when asked.

Save records it twice (docs/checkpoint_format.md): the model-states file's `ds_layout` (the summary a
load plans from without opening any optimizer-state file) and each optimizer-state file's
`ds_fragments` (that file's own fragments: name, group, flat offset, parameter offset, numel, and the
parameters' full shapes). Load (checkpoint/reader.py) builds the Description from `ds_layout`, or, for
files that record nothing (DeepSpeed 0.19.8's, ours from before), derives it from `param_shapes`, the
number of optimizer-state files and whether the tag is ZeRO-3; `plan` then says which byte ranges of
which files a slice of a parameter is, and when a file is opened its `ds_fragments` must equal what the
Description says that rank holds (`check_record`), so a file of another layout is named, never misread.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..runtime.zero.partition import BucketPartition, ParamwisePartition
from .files import CheckpointError

FRAGMENTS_KEY = "ds_fragments"   # in each optimizer-state file's optimizer_state_dict
LAYOUT_KEY = "ds_layout"         # in the model-states file(s)
VERSION = 1
FLAT, PARAMWISE = "flat", "paramwise"
KINDS = (FLAT, PARAMWISE)
ALIGNMENT = 2   # DeepSpeed pads each ZeRO-1/2 param group to a multiple of 2 x the saved rank count


@dataclass(frozen=True)
class Fragment:
    """A run of one parameter's flattened elements inside one saved rank's flat."""

    name: str
    shape: tuple[int, ...]   # the full parameter's
    group: int               # its optimizer param group
    rank: int                # the saved rank (file) holding it
    flat_offset: int         # where it starts in that file's flat (paramwise: the file's flats joined)
    param_offset: int        # where it starts in the parameter's flattened elements
    numel: int


class Read(NamedTuple):
    """One step of a plan: `numel` elements from `flat_offset` of saved rank `rank`'s flat number `flat`,
    landing at `out_offset` of the result."""

    rank: int
    flat: int
    flat_offset: int
    numel: int
    out_offset: int


class Description:
    """One tag's optimizer-state files at the data-parallel level ([Note: a checkpoint describes itself])."""

    def __init__(self, kind: str, world_size: int, groups: Sequence[Sequence[tuple[str, Any]]],
                 alignment: int = ALIGNMENT) -> None:
        if kind not in KINDS:
            raise CheckpointError(f"{LAYOUT_KEY}: kind {kind!r} is not one of {list(KINDS)}")
        for key, value in (("world_size", world_size), ("alignment", alignment)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"{LAYOUT_KEY}: {key} {value!r} must be a positive integer")
        self.kind, self.world_size, self.alignment = kind, world_size, alignment
        self.groups = tuple(tuple((str(n), tuple(int(d) for d in s)) for n, s in g) for g in groups)
        self._where: dict[str, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for i, (name, _) in enumerate(group):
                if name in self._where:
                    raise CheckpointError(f"{LAYOUT_KEY}: parameter {name!r} is listed twice (groups "
                                          f"{self._where[name][0]} and {g})")
                self._where[name] = (g, i)
        numels = [tuple(torch.Size(s).numel() for _, s in g) for g in self.groups]
        self.partitions = [ParamwisePartition(n, world_size) if kind == PARAMWISE
                           else BucketPartition(n, world_size, alignment) for n in numels]
        # paramwise: a reader joins a file's flats, so group g's pieces start after the groups before it
        self._base = tuple(itertools.accumulate((p.shard_numel for p in self.partitions[:-1]), initial=0)) \
            if kind == PARAMWISE else (0,) * len(self.partitions)

    # --- building ---------------------------------------------------------------------------
    @classmethod
    def of(cls, groups: Sequence[Sequence[tuple[str, Any]]], world_size: int, zero3: bool) -> "Description":
        """DeepSpeed's layout of `groups` ((name, shape) per parameter, per param group) saved by
        `world_size` ranks: what the writer cuts the files by, and what `derived` reads them by."""
        return cls(PARAMWISE if zero3 else FLAT, world_size, groups)

    @classmethod
    def derived(cls, param_shapes: Any, world_size: int, zero3: bool) -> "Description":
        """What files that record nothing hold: DeepSpeed's rule from `param_shapes` (one ordered
        {name: shape} per group), the number of optimizer-state files and whether the tag is ZeRO-3."""
        groups = [list(g.items()) for g in ([param_shapes] if isinstance(param_shapes, Mapping) else param_shapes)]
        return cls.of(groups, world_size, zero3)

    @classmethod
    def from_layout(cls, layout: Any, param_shapes: Any) -> "Description":
        """The Description a model-states file's `ds_layout` records (its shapes from `param_shapes`)."""
        if not isinstance(layout, Mapping) or layout.get("version") != VERSION:
            found = layout.get("version") if isinstance(layout, Mapping) else type(layout).__name__
            raise CheckpointError(f"{LAYOUT_KEY}: version {found!r} is not readable here (this build reads "
                                  f"version {VERSION})")
        shapes = {n: s for g in ([param_shapes] if isinstance(param_shapes, Mapping) else param_shapes or [])
                  for n, s in g.items()}
        order = layout.get("groups")
        if not isinstance(order, Sequence) or not all(isinstance(g, Sequence) for g in order):
            raise CheckpointError(f"{LAYOUT_KEY}: groups {order!r} must be a list of parameter-name lists")
        listed = [n for g in order for n in g]
        if set(listed) != set(shapes):
            raise CheckpointError(f"{LAYOUT_KEY}: its groups list {sorted(set(listed) - set(shapes))[:4]} that "
                                  f"param_shapes lacks and lack {sorted(set(shapes) - set(listed))[:4]} that it has")
        return cls(layout.get("kind"), layout.get("world_size"), [[(n, shapes[n]) for n in g] for g in order],
                   layout.get("alignment", ALIGNMENT))

    def layout(self) -> dict:
        """The `ds_layout` summary (plain types: any torch.load reads it)."""
        return {"version": VERSION, "kind": self.kind, "world_size": self.world_size, "alignment": self.alignment,
                "groups": [[n for n, _ in g] for g in self.groups]}

    def record(self, rank: int) -> dict:
        """Saved rank `rank`'s `ds_fragments`: its fragments and their parameters' full shapes."""
        found = self.fragments(rank)
        return {"version": VERSION, "kind": self.kind,
                "fragments": [(f.name, f.group, f.flat_offset, f.param_offset, f.numel) for f in found],
                "shapes": {f.name: list(f.shape) for f in found}}

    # --- asking -----------------------------------------------------------------------------
    @property
    def num_flats(self) -> int:
        """Flats per field a reader keeps for each file: one per group, or one joined (paramwise)."""
        return 1 if self.kind == PARAMWISE else len(self.groups)

    def names(self) -> list[str]:
        return [n for g in self.groups for n, _ in g]

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        g, i = self._where[name]
        return self.groups[g][i][1]

    def fragments(self, rank: int) -> list[Fragment]:
        """Saved rank `rank`'s fragments, in the order its flats hold them (O(params) time, not stored)."""
        out = []
        for g, partition in enumerate(self.partitions):
            for f in partition.fragments(rank):
                name, shape = self.groups[g][f.index]
                out.append(Fragment(name, shape, g, rank, self._base[g] + f.shard_start, f.param_start, f.numel))
        return out

    def plan(self, name: str, start: int = 0, numel: int | None = None) -> list[Read]:
        """The reads that assemble elements [start, start+numel) of `name`'s flattened elements: pure."""
        if name not in self._where:
            raise CheckpointError(f"no parameter named {name!r} in the checkpoint's description")
        g, i = self._where[name]
        total = torch.Size(self.groups[g][i][1]).numel()
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(f"elements [{start}, {start + numel}) of {name!r} asked for; it has {total}")
        flat = 0 if self.kind == PARAMWISE else g
        return [Read(rank, flat, self._base[g] + at, length, dst)
                for rank, at, length, dst in self.partitions[g].placements(i, start, numel)]

    def check_record(self, record: Any, rank: int, file: str) -> None:
        """Raise when file `file` (saved rank `rank`) records fragments other than this Description's."""
        recorded = recorded_fragments(record, rank, file)
        if record.get("kind") != self.kind:
            raise CheckpointError(f"{file}: its {FRAGMENTS_KEY} are of kind {record.get('kind')!r}, the checkpoint's "
                                  f"description ({self.summary()}) of kind {self.kind!r}")
        expected = self.fragments(rank)
        if recorded == expected:
            return
        first = next((a, b) for a, b in itertools.zip_longest(recorded, expected) if a != b)
        name = (first[0] or first[1]).name
        show = lambda fs: [_brief(f) for f in fs if f.name == name] or "nothing"   # noqa: E731
        raise CheckpointError(f"{file}: its {FRAGMENTS_KEY} do not match the checkpoint's description for "
                              f"parameter {name!r}: the file records {show(recorded)}, the description "
                              f"({self.summary()}) says {show(expected)}")

    def summary(self) -> str:
        return f"{self.kind}, {self.world_size} saved ranks, alignment {self.alignment}, " \
               f"{len(self.groups)} groups of {[len(g) for g in self.groups]} parameters"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Description) and (self.kind, self.world_size, self.alignment, self.groups) == \
            (other.kind, other.world_size, other.alignment, other.groups)

    def __repr__(self) -> str:
        return f"Description({self.summary()})"


def _brief(f: Fragment) -> str:
    return f"(group {f.group}, rank {f.rank}, flat offset {f.flat_offset}, param offset {f.param_offset}, " \
           f"numel {f.numel}, shape {list(f.shape)})"


def recorded_fragments(record: Any, rank: int, file: str) -> list[Fragment]:
    """The fragments a file's `ds_fragments` record (saved rank `rank`), checked for form."""
    if not isinstance(record, Mapping) or record.get("version") != VERSION:
        found = record.get("version") if isinstance(record, Mapping) else type(record).__name__
        raise CheckpointError(f"{file}: {FRAGMENTS_KEY} version {found!r} is not readable here (this build "
                              f"reads version {VERSION})")
    shapes = record.get("shapes") or {}
    out = []
    for entry in record.get("fragments") or []:
        if len(entry) != 5 or entry[0] not in shapes:
            raise CheckpointError(f"{file}: {FRAGMENTS_KEY} entry {entry!r} is not (name, group, flat offset, "
                                  "param offset, numel) of a parameter listed in its shapes")
        name, group, flat_offset, param_offset, numel = entry
        out.append(Fragment(name, tuple(int(d) for d in shapes[name]), int(group), rank, int(flat_offset),
                            int(param_offset), int(numel)))
    return out
