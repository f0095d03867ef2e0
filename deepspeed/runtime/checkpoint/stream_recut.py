"""The streamed re-cut of NVMe-offloaded optimizer state when elements change rank: [Note: streamed re-cut].

[Note: streamed re-cut]
At ZeRO-1/2 on more than one rank DeepSpeed's flat layout puts elements of one rank's buckets into
another rank's file, so building the file needs an all-to-all. That collective must not run while
files are written (a rank failing to write would leave the others waiting in it), and the file's
flats must not be built in memory (they are the rank's whole state). So the exchange runs in the
save's collective phase, window by window: for each record (field, group) of the file, in the same
order on every rank, each window of at most `window` elements of every rank's flat is assembled (the
pieces staying here read from the swap files, the others received in one all-to-all whose send side
is read from the swap files too) and written to a spill file in the run's swap directory; the
file's StreamedTensors then read the spill file. In memory at a time: one window, what this rank
sends for the other ranks' same window, and what it receives. A failed read or write on a rank
does not stop its part in the exchange (zeros stand in): it is raised when the file is written,
inside the save's agreed phase, so every rank raises and none hangs. The spill file is removed
when the save ends (`drop`), or with the swap directory.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from ... import comm as ds_comm
from ..swap_tensor.swap_files import pread_exact

WINDOW: int | None = None   # elements per window (None: about 16 MiB over all ranks; tests set a few)


class SpilledRecut:
    """The exchange's result: per field, per group, a StreamedTensor reading the spill file."""

    def __init__(self, hp: Any, fields: list[str], layouts: list[Any], rank: int, strip_padding: set[str],
                 sends: list[list[tuple]], receives: list[list[tuple]], local: list[tuple]) -> None:
        from ...checkpoint.stream_save import CHUNK_BYTES

        self.hp, self.path = hp, hp.swapper.dir.file("checkpoint_recut.spill")
        self.error: BaseException | None = None
        world = len(sends)
        self.window = WINDOW or max(1 << 16, CHUNK_BYTES // 4 // world)   # elements: about 16 MiB of fp32 in all
        self.records: list[tuple[str, int, int, int]] = []      # (field, group, numel here, offset in the spill)
        offset = 0
        for field in fields:
            for g, layout in enumerate(layouts):
                numel = layout.shard_numel - (layout.padding(rank) if field in strip_padding else 0)
                self.records.append((field, g, numel, offset))
                offset += numel
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for field, g, numel, at in self.records:
                for lo in range(0, layouts[g].shard_numel, self.window):   # the same windows on every rank
                    hi = min(lo + self.window, layouts[g].shard_numel)
                    out = self._window(field, g, lo, hi, sends, receives, local)
                    if self.error is None and lo < numel:
                        self._guard(lambda: _pwrite_all(fd, out[:min(hi, numel) - lo], (at + lo) * 4))
        finally:
            os.close(fd)

    def _guard(self, fn: Any, fallback: Any = None) -> Any:
        """fn(), or (after a failure, kept for the write) `fallback`: the exchange goes on."""
        if self.error is not None:
            return fallback
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - raised when the file is written (agreed there)
            self.error = error
            return fallback

    def _values(self, piece: Any, field: str, start: int, n: int) -> torch.Tensor:
        """n fp32 values of the piece's field from `start` (zeros where it has none, or after a failure)."""
        source = self.hp._stored(piece, field)
        zeros = torch.zeros(n, dtype=torch.float32)  # host: checkpoint window
        if source is None:
            return zeros
        i, fragment, key, offset = source
        read = self._guard(lambda: torch.cat(list(self.hp.swapper.read_slice(i, fragment, key, offset + start, n))))
        return zeros if read is None else read

    def _window(self, field: str, g: int, lo: int, hi: int, sends: list, receives: list,
                local: list) -> torch.Tensor:
        """Elements [lo, hi) of this rank's flat of (field, group g); collective over the data-parallel group."""
        def clipped(at: int, n: int) -> tuple[int, int] | None:
            a, b = max(at, lo), min(at + n, hi)
            return (a, b - a) if a < b else None

        parts, in_splits = [], []
        for ss in sends:   # what the other ranks' same window needs from here, in plan order
            count = 0
            for piece, src, n, gg, at in ss:
                cut = clipped(at, n) if gg == g else None
                if cut is not None:
                    parts.append(self._values(piece, field, src + cut[0] - at, cut[1]))
                    count += cut[1]
            in_splits.append(count)
        placed = [[c for gg, at, n in rs if gg == g for c in [clipped(at, n)] if c is not None] for rs in receives]
        out_splits = [sum(n for _, n in rs) for rs in placed]
        device = self.hp.wrapper._comm_device
        send = (torch.cat(parts) if parts else torch.zeros(0)).to(device)  # host: empty send
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        work = ds_comm.all_to_all_single(recv, send, out_splits, in_splits, group=self.hp.wrapper.group,
                                         async_op=True)
        out = torch.zeros(hi - lo, dtype=torch.float32)  # host: checkpoint window (padding stays zero)
        for piece, src, n, gg, at in local:
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

    def tensors(self) -> dict[str, list[Any]]:
        from ...checkpoint.stream_save import CHUNK_BYTES, StreamedTensor

        def produce(numel: int, at: int):
            def chunks() -> Iterator[torch.Tensor]:
                if self.error is not None:
                    raise self.error
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    for lo in range(0, numel, CHUNK_BYTES // 4):
                        chunk = torch.empty(min(CHUNK_BYTES // 4, numel - lo), dtype=torch.float32)  # host: read
                        pread_exact(fd, chunk, (at + lo) * 4, self.path)
                        yield chunk
                finally:
                    os.close(fd)
            return chunks

        out: dict[str, list[Any]] = {}
        for field, g, numel, at in self.records:
            out.setdefault(field, []).append(StreamedTensor(numel, torch.float32, produce(numel, at)))
        return out

    def drop(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _pwrite_all(fd: int, tensor: torch.Tensor, offset: int) -> None:
    view = memoryview(tensor.contiguous().view(torch.uint8).numpy())
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done

