"""The optimizer-state files of a checkpoint tag, as CheckpointReader (reader.py) reads them: each saved rank's
file opened on first use and kept (`RankFiles`, [Note: reading only what a rank needs]), and one rank's
per-group flats read as one without concatenating them (`joined`: a ZeRO-3 file's per-parameter walk spans
its groups)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Joined:
    """One rank's per-group flats read as one (a stage-3 file's per-parameter walk spans its groups)
    without concatenating them: the memory-mapped files are read only where sliced, and a slice copies
    only when it crosses from one group's flat into the next."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts, self.starts, at = parts, [], 0
        for part in parts:
            self.starts.append(at)
            at += part.numel()
        self._numel = at

    def numel(self) -> int:
        return self._numel

    def reshape(self, *shape: Any) -> "Joined":
        return self

    def __getitem__(self, where: slice) -> torch.Tensor:
        lo, hi, _ = where.indices(self._numel)
        pieces = [part[max(lo - start, 0):min(hi - start, part.numel())]
                  for part, start in zip(self.parts, self.starts) if start < hi and start + part.numel() > lo]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.zeros(0, device="cpu")   # host: an empty read


def joined(parts: list[torch.Tensor]) -> Any:
    """`parts` (1-D or not) as one flat: the tensor itself when there is one, else a `Joined`."""
    flats = [t.reshape(-1) for t in parts]
    return flats[0] if len(flats) == 1 else Joined(flats)


class RankFiles(Sequence):
    """Each saved rank's optimizer-state file (its whole content), opened on first use and kept."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self._loaded: dict[int, dict] = {}
        self.first: int | None = None   # the rank of the first file opened

    def __len__(self) -> int:
        return len(self._reader.rank_files)

    def __getitem__(self, rank: Any) -> Any:
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        rank = range(len(self))[rank]
        if rank not in self._loaded:
            state = self._reader._load(self._reader.rank_files[rank])
            self._reader._opened(rank, state)
            self._loaded[rank] = state
            self.first = rank if self.first is None else self.first
        return self._loaded[rank]

    def opened(self) -> list[int]:
        return sorted(self._loaded)


class OptimizerStates(Sequence):
    """`optimizer_state_dict` of each saved rank's file, opened on first use."""

    def __init__(self, files: RankFiles) -> None:
        self._files = files

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, rank: Any) -> Any:
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        return self._files[rank]["optimizer_state_dict"]
