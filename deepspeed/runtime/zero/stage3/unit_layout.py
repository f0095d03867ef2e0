"""UnitLayout: where each parameter of a ZeRO-3 gather unit lives in the shard, in the all-gather
buffer and in the gathered (parameter-major) buffer. Pure tensor math, no communication.

[Note: ZeRO-3 parameter-major shards]
Each parameter is split on its own, as upstream's ZeRO-3 does: rank r holds elements
[r*s, (r+1)*s) of a parameter of n elements, s = ceil(n/N), the last ranks' pieces padded with
zeros. A rank's unit shard is its pieces of the unit's parameters concatenated in unit order
(`ParamwisePartition`), so each parameter's piece -- upstream's `param.ds_tensor` -- is a
contiguous view of the shard, of upstream's size. Three buffers share the unit's padded size
N*S (S = sum of the s's = the shard's size):

    shard (rank r)      [p1 piece r | p2 piece r | ...]                                  S
    all-gather buffer   [p1 piece 0 | p2 piece 0 | ... | p1 piece 1 | p2 piece 1 | ...]  N x S
    gathered `flat`     [p1 (padded to N*s1) | p2 (padded to N*s2) | ...]                N x S

A unit is still ONE all-gather (into the rank-major buffer) and ONE reduce-scatter (of a
rank-major gradient buffer, whose output row r is laid out like the shard: the gradient shard
matches the parameter shard element for element). Gathering then moves each parameter's N
pieces into its contiguous place in `flat` (one strided copy per parameter; upstream does the
same with a torch.cat per parameter), whose views are the parameters' `.data`. Where the two
buffers coincide (world size 1, or at most one non-empty parameter) the all-gather writes
`flat` directly. The price against a unit-wide split (padding at the unit's end only): at most
N-1 padding elements per parameter instead of per unit, and one extra copy of the unit per
gather; the gain is upstream's per-parameter shard, which libraries read and write
(`ds_tensor`), and which is exactly the per-parameter layout of DeepSpeed's stage-3
checkpoints.
"""

from __future__ import annotations

import torch

from ..partition import ParamwisePartition


class UnitLayout:
    """Offsets of a unit's parameters in its shard, all-gather buffer and gathered buffer."""

    def __init__(self, numels: tuple[int, ...], world: int, flat_offsets: list[int] | None = None) -> None:
        """`flat_offsets`: where the parameters sit in the gathered buffer (default: this layout's
        own parameter-major order; hpZ's secondary layout reads and writes the primary's)."""
        self.numels, self.world = tuple(numels), world
        self.partition = ParamwisePartition(self.numels, world)
        self.sizes = [-(-n // world) for n in self.numels]        # s: each parameter's piece
        self.starts, at = [], 0                                   # piece offsets inside a shard
        for s in self.sizes:
            self.starts.append(at)
            at += s
        self.shard_numel = at
        self.padded_numel = at * world
        self.offsets = [world * a for a in self.starts] if flat_offsets is None else list(flat_offsets)
        # Rank-major and parameter-major orders are the same buffer when no row holds two pieces.
        self.direct = flat_offsets is None and (world == 1 or sum(1 for n in self.numels if n) <= 1)

    def piece(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s piece of a shard laid out like this unit (a view)."""
        a = self.starts[index]
        return shard[a:a + self.sizes[index]]

    def row(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard cut from a gathered (parameter-major) buffer: a new tensor."""
        if self.direct:
            return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()
        return torch.cat([flat[o + rank * s:o + (rank + 1) * s] for o, s in zip(self.offsets, self.sizes)])

    def unpack(self, gathered: torch.Tensor, flat: torch.Tensor) -> None:
        """All-gather buffer (rank-major) -> gathered buffer (parameter-major)."""
        rows = gathered.view(self.world, self.shard_numel)
        for o, a, s in zip(self.offsets, self.starts, self.sizes):
            if s:
                flat[o:o + self.world * s].view(self.world, s).copy_(rows[:, a:a + s])

    def split(self, gathered: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """All-gather buffer (rank-major) -> one new tensor per parameter, of its shape."""
        rows = gathered.view(self.world, self.shard_numel)
        out = []
        for n, a, s, shape in zip(self.numels, self.starts, self.sizes, shapes):
            value = torch.empty(n, dtype=gathered.dtype, device=gathered.device)
            if n:
                k, rest = divmod(n, s)
                value[:k * s].view(k, s).copy_(rows[:k, a:a + s])
                if rest:
                    value[k * s:].copy_(rows[k, a:a + rest])
            out.append(value.view(shape))
        return out

    def pack_into(self, rows: torch.Tensor, index: int, values: torch.Tensor) -> None:
        """Write parameter `index`'s flattened `values` (its full numel) into a rank-major buffer
        viewed as (N, S) `rows`, piece r into row r; the padding is left as it is."""
        n, a, s = values.numel(), self.starts[index], self.sizes[index]
        if not n:
            return
        k, rest = divmod(n, s)
        if k:
            rows[:k, a:a + s].copy_(values[:k * s].view(k, s))
        if rest:
            rows[k, a:a + rest].copy_(values[k * s:])
