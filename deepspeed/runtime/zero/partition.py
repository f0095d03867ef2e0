"""Pure partition math: which slice of each gradient bucket every rank owns.

[Note: per-bucket shards]
A bucket is a run of parameters flattened in gradient-ready order and padded to a multiple
of the world size N; rank r owns elements [r*S, (r+1)*S) of it (S = padded / N). Reducing a
bucket is then one reduce-scatter whose output is exactly the owner's slice, and refreshing
parameters after the step is one all-gather of the same layout: per step each rank sends
2Ψ(N-1)/N elements, DDP's volume, with one collective per bucket in each direction. A
parameter may straddle two ranks' slices; its pieces are "fragments".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator


@dataclass(frozen=True)
class Fragment:
    """The part of parameter `index` (within its bucket) that lies in one rank's shard."""

    index: int          # position of the parameter in the bucket
    param_start: int    # offset inside the flattened parameter
    shard_start: int    # offset inside the owner's shard
    numel: int


@dataclass(frozen=True)
class BucketPartition:
    """Parameters flattened back to back, padded at the end, split in N equal shards.

    `alignment` > 1 pads to a multiple of alignment*N: DeepSpeed's ZeRO-1/2 checkpoint layout
    (one such flat per optimizer param group, alignment 2) is this same partition.
    """

    numels: tuple[int, ...]
    world_size: int
    alignment: int = 1

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        unit = self.alignment * self.world_size
        return -(-self.numel // unit) * unit // self.world_size

    def padding(self, rank: int) -> int:
        """Padding elements at the end of `rank`'s shard (only the last shards have any)."""
        lo = rank * self.shard_numel
        return self.shard_numel - max(0, min(self.numel - lo, self.shard_numel))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.numels[:-1], initial=0)) if self.numels else ()

    def offsets(self) -> list[int]:
        return list(self._starts)

    def fragments(self, rank: int) -> list[Fragment]:
        """Fragments owned by `rank`, in bucket order."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        found = []
        for index, (start, n) in enumerate(zip(self.offsets(), self.numels)):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                found.append(Fragment(index, a - start, a - lo, b - a))
        return found

    def placements(self, index: int, start: int, numel: int) -> Iterator[tuple[int, int, int, int]]:
        """Where elements [start, start+numel) of parameter `index` go: (rank, offset in that
        rank's shard, length, offset from `start`) per contiguous run."""
        lo = self._starts[index] + start
        hi, first, size = lo + numel, lo, self.shard_numel
        while lo < hi:
            rank = lo // size
            end = min(hi, (rank + 1) * size)
            yield rank, lo - rank * size, end - lo, lo - first
            lo = end

    def owners(self, index: int) -> list[int]:
        """Ranks holding a piece of parameter `index`."""
        start, n = self.offsets()[index], self.numels[index]
        if n == 0:
            return []
        return list(range(start // self.shard_numel, (start + n - 1) // self.shard_numel + 1))


@dataclass(frozen=True)
class ParamwisePartition:
    """Every parameter split on its own: rank r holds elements [r*s, (r+1)*s) of each parameter
    (s = ceil(numel/N), the last piece zero-padded), its pieces concatenated in parameter order.
    DeepSpeed's ZeRO-3 checkpoints store each param group's `fp32_flat_groups` this way, and our
    ZeRO-3 gather units shard their parameters this way (stage3/unit_layout.py)."""

    numels: tuple[int, ...]
    world_size: int

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        """Offset of each parameter's piece inside any rank's shard."""
        sizes = [-(-n // self.world_size) for n in self.numels]
        return tuple(itertools.accumulate(sizes[:-1], initial=0)) if sizes else ()

    @property
    def shard_numel(self) -> int:
        return self._starts[-1] + -(-self.numels[-1] // self.world_size) if self.numels else 0

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def padding(self, rank: int) -> int:
        return self.shard_numel - sum(f.numel for f in self.fragments(rank))

    def placements(self, index: int, start: int, numel: int) -> Iterator[tuple[int, int, int, int]]:
        """As BucketPartition.placements: parameter `index`'s piece s of ceil(numel/N) elements
        goes to rank s, after the pieces of the parameters before it."""
        size = -(-self.numels[index] // self.world_size)
        before = self._starts[index]
        lo, hi = start, start + numel
        while lo < hi:
            rank = lo // size
            end = min(hi, (rank + 1) * size)
            yield rank, before + lo - rank * size, end - lo, lo - start
            lo = end

    def owners(self, index: int) -> list[int]:
        """Ranks holding a piece of parameter `index` (all but those whose piece is all padding)."""
        n = self.numels[index]
        return list(range(-(-n // -(-n // self.world_size)))) if n else []

    def fragments(self, rank: int) -> list[Fragment]:
        found, offset = [], 0
        for index, n in enumerate(self.numels):
            size = -(-n // self.world_size)
            lo = rank * size
            if lo < n:
                found.append(Fragment(index, lo, offset, min(size, n - lo)))
            offset += size
        return found
