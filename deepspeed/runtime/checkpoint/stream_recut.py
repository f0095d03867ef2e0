"""The streamed re-cut of NVMe-offloaded optimizer state when elements change rank: [Note: streamed re-cut].

[Note: streamed re-cut]
At ZeRO-1/2 on more than one rank DeepSpeed's flat layout puts elements of one rank's buckets into
another rank's file, so building the file needs an all-to-all, and the file's flats must not be
built in memory (they are the rank's whole state). So the file is written while the exchange runs,
in the save's collective phase, window by window: each record (field, group) of the file, in the
order the file holds them (the same on every rank: the same object is pickled), is produced one
window of at most `window` elements at a time (the pieces staying here read from the swap files,
the others received in one all-to-all whose send side is read from the swap files too) and written
straight into the file's `.tmp` in the staging directory. The bytes are written once: no spill file.

A failure must neither hang the other ranks nor publish anything. A failed swap-file read or file
write on a rank does not stop its part in the exchange: the rest of the windows are still exchanged
(zeros sent, nothing written, `drain`), and the failure is kept (`files.Written`) and raised when
the save's agreed write phase reaches the file (`files.save_file`), so every rank raises and the
`.tmp` is removed; until that phase succeeded on every rank the staging directory is not published,
so a crash leaves the previous checkpoint loadable ([Note: crash-safe save]). In memory at a time:
one window, what this rank sends for the other ranks' same window, and what it receives.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ... import comm as ds_comm
from ...checkpoint import files
from ...checkpoint.stream_save import CHUNK_BYTES, Streamed, StreamedTensor, streamed_in_order

WINDOW: int | None = None   # elements per window (None: about 16 MiB over all ranks; tests set a few)


class ExchangedRecut:
    """The re-cut's StreamedTensors (`tensors`) and the exchange that produces them while `write` writes
    the file: collective over the data-parallel group, the same windows in the same order on every rank."""

    def __init__(self, hp: Any, fields: list[str], layouts: list[Any], rank: int, strip_padding: set[str],
                 sends: list[list[tuple]], receives: list[list[tuple]], local: list[tuple]) -> None:
        self.hp, self.layouts = hp, layouts
        self.sends, self.receives, self.local = sends, receives, local
        self.error: BaseException | None = None
        self.window = WINDOW or max(1 << 16, CHUNK_BYTES // 4 // len(sends))   # about 16 MiB of fp32 in all
        self._schedule: list[tuple[str, int, int, int]] = []   # (field, group, lo, hi) in the file's order
        self._done = 0                                          # windows exchanged so far
        self._keys: dict[int, tuple[str, int]] = {}
        self.parts: dict[str, list[StreamedTensor]] = {}
        for field in fields:
            for g, layout in enumerate(layouts):
                numel = layout.shard_numel - (layout.padding(rank) if field in strip_padding else 0)
                tensor = StreamedTensor(numel, torch.float32, self._producer(field, g, numel))
                self._keys[id(tensor)] = (field, g)
                self.parts.setdefault(field, []).append(tensor)

    def write(self, obj: Streamed, path: str) -> files.Written:
        """Write `obj` (holding `parts`) to `<path>.tmp` while exchanging; every window is exchanged
        whatever fails. The failure is returned, to be raised in the agreed write phase."""
        order = [self._keys[id(t)] for t in streamed_in_order(obj.obj) if id(t) in self._keys]
        self._schedule = [(field, g, lo, min(lo + self.window, self.layouts[g].shard_numel))
                          for field, g in order for lo in range(0, self.layouts[g].shard_numel, self.window)]
        written = files.write_tmp(obj, path)
        self.error = self.error or written.error   # from here on zeros are sent: the save fails anyway
        while self._done < len(self._schedule):    # the windows a failed write did not reach
            self._window(*self._schedule[self._done])
            self._done += 1
        return files.Written(written.error or self.error, written.size)

    def _producer(self, field: str, g: int, numel: int) -> Any:
        def chunks() -> Iterator[torch.Tensor]:
            for lo in range(0, self.layouts[g].shard_numel, self.window):
                if self._schedule[self._done][:3] != (field, g, lo):
                    raise RuntimeError(f"streamed re-cut: record ({field}, group {g}) read out of the file's order")
                hi = self._schedule[self._done][3]
                out = self._window(field, g, lo, hi)
                self._done += 1
                if self.error is not None:
                    raise self.error
                if lo < numel:
                    yield out[:min(hi, numel) - lo]
        return chunks

    def _guard(self, fn: Any, fallback: Any = None) -> Any:
        """fn(), or (after a failure, kept for the write phase) `fallback`: the exchange goes on."""
        if self.error is not None:
            return fallback
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - raised in the write phase (agreed there)
            self.error = error
            return fallback

    def _values(self, piece: Any, field: str, start: int, n: int) -> torch.Tensor:
        """n fp32 values of the piece's field from `start` (zeros where it has none, or after a failure)."""
        read = self._guard(lambda: torch.cat(list(self.hp._stored_chunks(piece, field, start, n))))
        return torch.zeros(n, dtype=torch.float32) if read is None else read  # host: checkpoint window

    def _window(self, field: str, g: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of this rank's flat of (field, group g); collective over the data-parallel group."""
        def clipped(at: int, n: int) -> tuple[int, int] | None:
            a, b = max(at, lo), min(at + n, hi)
            return (a, b - a) if a < b else None

        parts, in_splits = [], []
        for ss in self.sends:   # what the other ranks' same window needs from here, in plan order
            count = 0
            for piece, src, n, gg, at in ss:
                cut = clipped(at, n) if gg == g else None
                if cut is not None:
                    parts.append(self._values(piece, field, src + cut[0] - at, cut[1]))
                    count += cut[1]
            in_splits.append(count)
        placed = [[c for gg, at, n in rs if gg == g for c in [clipped(at, n)] if c is not None] for rs in self.receives]
        out_splits = [sum(n for _, n in rs) for rs in placed]
        device = self.hp.wrapper._comm_device
        send = (torch.cat(parts) if parts else torch.zeros(0)).to(device)  # host: empty send
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        work = ds_comm.all_to_all_single(recv, send, out_splits, in_splits, group=self.hp.wrapper.group,
                                         async_op=True)
        out = torch.zeros(hi - lo, dtype=torch.float32)  # host: checkpoint window (padding stays zero)
        for piece, src, n, gg, at in self.local:
            cut = clipped(at, n) if gg == g else None
            if cut is not None:
                out[cut[0] - lo:cut[0] - lo + cut[1]].copy_(self._values(piece, field, src + cut[0] - at, cut[1]))
        work.wait()
        received, k = recv.cpu(), 0
        for rs in placed:
            for a, n in rs:
                out[a - lo:a - lo + n].copy_(received[k:k + n])
                k += n
        return out
