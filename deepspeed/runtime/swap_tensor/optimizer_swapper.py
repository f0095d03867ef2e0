"""Optimizer state on NVMe (`offload_optimizer.device: "nvme"`): [Note: optimizer state swapping].

[Note: optimizer state swapping]
The ZeRO optimizers keep, per shard (a gradient bucket at stages 1-2, a gather unit at stage 3),
an fp32 master slice whose fragments the base torch optimizer steps, and that optimizer's per-
fragment state (Adam's moments, a momentum buffer). With NVMe offload each shard's master and state
tensors live in one file of the run's swap directory ([Note: swap file ownership]) between uses,
every tensor of every size (upstream never swaps pieces under 1 MiB). The tensor objects stay (the
optimizer's state keys and the fragment masters' identities are kept); swapped out, each is a
stride-0 view of one NaN with its shape, so a stray read gives NaN and a stray write raises, never
stale numbers. A swapped-in shard's tensors are views of one 4 KiB-aligned buffer at aligned file
offsets, so the whole shard moves in one direct-I/O request.

The step walks the shards in order (`pipelined`): shard i+1 is read while shard i is updated (the
base optimizer run on shard i's fragments alone: torch optimizers keep per-tensor state, so this is
the same update as one step over all), and shard i-1 is written meanwhile; at most three shards are
in memory. After its update a shard publishes its new values to the model side (`publish()`), so
the all-gather (stages 1-2) or the shard refresh (stage 3) after the step needs no master. An I/O
error is agreed across ranks before that collective: every rank raises, naming the failing rank's
path and cause. Checkpoints use the CPU-offload code, so they have its layout, and stream: a save
(`streaming`: the writer touches shards in order and exactly one is in memory at a time, read-only);
a load (`load_streamed`: the base optimizer's `load_state_dict` first, then shard by shard the master
read, overwritten with the checkpoint's values, published and written back with the loaded state). `resident_bytes` /
`peak_resident_bytes` count the swap buffers in memory (tests bound them). Gradients stay in host
memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from typing import Any, Callable, Iterator

import torch

from ...ops.aio.handle import ALIGNMENT, aio_handle, aligned_host_tensor
from ..agreement import agreed
from .swap_files import SwapDir, pread_exact

_NAN = torch.full((1,), float("nan"), device="cpu")   # host: the placeholder all swapped-out tensors view


def placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A stride-0 view of one NaN (or zero, for integer dtypes) with `shape`: no memory."""
    one = _NAN.to(dtype) if dtype.is_floating_point else torch.zeros(1, dtype=dtype, device="cpu")  # host: placeholder
    return one.expand(shape) if len(shape) else one.view(())


class _Entry:
    """One tensor of a shard's file: the master (`fragment` None) or a state tensor `key` of a fragment."""

    __slots__ = ("fragment", "key", "dtype", "shape", "offset", "nbytes", "tensor")

    def __init__(self, fragment: Any, key: Any, tensor: torch.Tensor, offset: int) -> None:
        self.fragment, self.key = fragment, key
        self.tensor = None if fragment is None else tensor   # the state object it fills (not a master view)
        self.dtype, self.shape, self.offset = tensor.dtype, tensor.shape, offset
        self.nbytes = tensor.numel() * tensor.element_size()


class OptimizerStateSwapper:
    """Keeps a ZeRO optimizer's masters and optimizer state in files ([Note: optimizer state swapping])."""

    def __init__(self, wrapper: Any, shards: list[Any], aio: Any, nvme_path: str, rank: int,
                 buffer_count: int = 4) -> None:
        self.optimizer: torch.optim.Optimizer = wrapper.optimizer
        self.shards, self.group = shards, wrapper.group
        self.dir = SwapDir(nvme_path, "optimizer", rank)
        self.reader, self.writer = aio_handle(*aio.handle_args()), aio_handle(*aio.handle_args())
        self._layouts: list[list[_Entry]] = [[] for _ in shards]
        self._buffers: dict[int, torch.Tensor] = {}   # shard index -> its resident buffer
        # freed buffers kept for reuse (`buffer_count` at most): no allocation, no page faults per read
        self._spare: list[torch.Tensor] = []
        self._spare_count = max(0, int(buffer_count))
        self._params_of: list[list[list[torch.Tensor]]] = []   # per shard, per param group: its fragments
        for shard in shards:
            mine = {id(m) for m, _ in shard.fragment_masters}
            self._params_of.append([[p for p in g["params"] if id(p) in mine] for g in self.optimizer.param_groups])
        for i, shard in enumerate(shards):   # a write into one master outside the step (GatheredParameters)
            shard.resident = functools.partial(self.shard_resident, i)
        self.wait_s = 0.0          # seconds the optimizer waited on reads/writes (last step)
        self.everything_resident = False
        self.resident_bytes = self.peak_resident_bytes = 0   # swap buffers in memory (and their peak)
        self._held: int | None = None    # `streaming`: the one shard read in for a reader (clean)
        self._streaming = False
        self._view: SaveView | None = None   # a background checkpoint save still reading the files
        self._view_lock = threading.Lock()
        for i in range(len(shards)):   # the masters start on disk
            self._buffers[i] = shards[i].master
            self._write(i)
            self._wait(self.writer)
            self._free(i)

    # --- one shard ------------------------------------------------------------------------------
    def _path(self, i: int) -> str:
        return self.dir.file(f"shard_{i:05d}.swp")

    def _state_tensors(self, i: int) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        for fragment, _ in self.shards[i].fragment_masters:
            state = self.optimizer.state.get(fragment, {})
            for key in sorted(state, key=str):
                value = state[key]
                if torch.is_tensor(value) and value.dim() > 0 and value.device.type == "cpu":
                    yield fragment, key, value

    def _write(self, i: int) -> None:
        """Start writing shard i (its layout taken now: the first step adds the optimizer state)."""
        self._keep_for_save(i)
        layout, offset = [], 0
        tensors = [(None, None, self.shards[i].master), *self._state_tensors(i)]
        for fragment, key, tensor in tensors:
            entry = _Entry(fragment, key, tensor, offset)
            layout.append(entry)
            offset += -(-entry.nbytes // ALIGNMENT) * ALIGNMENT
            if entry.nbytes:
                self.writer.async_pwrite(tensor.contiguous().view(-1), self._path(i), entry.offset)
        self._layouts[i] = layout

    def _bind(self, i: int, entry: _Entry, value: torch.Tensor) -> None:
        shard = self.shards[i]
        if entry.fragment is None:
            shard.master = value
            for fragment, f in shard.fragment_masters:   # .data: identity and .grad kept
                fragment.data = value[f.shard_start:f.shard_start + f.numel]
        else:
            self.optimizer.state[entry.fragment][entry.key].set_(value)

    def _read(self, i: int, replaced_kept: bool = False) -> None:
        """Start reading shard i into a fresh aligned buffer its tensors are rebound to. With
        `replaced_kept` (a checkpoint load), state tensors the optimizer replaced since the layout
        was taken keep their new values: only the master and the state still in place are bound."""
        layout = self._layouts[i]
        total = layout[-1].offset + layout[-1].nbytes
        buffer = self._take_buffer(total)
        for entry in layout:
            if replaced_kept and entry.fragment is not None and \
                    self.optimizer.state.get(entry.fragment, {}).get(entry.key) is not entry.tensor:
                continue
            self._bind(i, entry, buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape))
        self._buffers[i] = buffer
        self._count(buffer.numel())
        if total:
            self.reader.async_pread(buffer[:total], self._path(i), 0)

    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        """An aligned host buffer of at least `nbytes`: the smallest spare one that fits, else a new one."""
        fits = [k for k, b in enumerate(self._spare) if b.numel() >= nbytes]
        if fits:
            return self._spare.pop(min(fits, key=lambda k: self._spare[k].numel()))
        return aligned_host_tensor(nbytes, torch.uint8)

    def _free(self, i: int) -> None:
        for entry in self._layouts[i]:
            self._bind(i, entry, placeholder(entry.shape, entry.dtype))
        buffer = self._buffers.pop(i, None)
        if buffer is not None and buffer.dtype == torch.uint8:
            self._count(-buffer.numel())
        if buffer is not None and buffer.dtype == torch.uint8 and self._spare_count:
            self._spare.append(buffer)
            if len(self._spare) > self._spare_count:   # keep the largest ones
                self._spare.pop(min(range(len(self._spare)), key=lambda k: self._spare[k].numel()))

    def _count(self, delta: int) -> None:
        self.resident_bytes += delta
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _wait(self, handle: aio_handle) -> None:
        start = time.perf_counter()
        try:
            handle.wait()
        finally:
            self.wait_s += time.perf_counter() - start

    # --- walks ----------------------------------------------------------------------------------
    def pipelined(self, dirty: bool = True) -> Iterator[int]:
        """Yield each shard's index with the shard in memory, reading the next and (`dirty`) writing
        the previous one meanwhile. With everything resident already, just the indices."""
        if self.everything_resident:
            yield from range(len(self.shards))
            return
        count, writing = len(self.shards), []
        try:
            if count:
                self._read(0)
            for i in range(count):
                self._wait(self.reader)
                if i + 1 < count:
                    self._read(i + 1)
                yield i
                if writing:
                    self._wait(self.writer)
                    self._free(writing.pop())
                if dirty:
                    self._write(i)
                    writing.append(i)
                else:
                    self._free(i)
            if writing:
                self._wait(self.writer)
                self._free(writing.pop())
        finally:   # an error: let the threads finish with the buffers, then leave all on disk
            for handle in (self.reader, self.writer):
                with contextlib.suppress(Exception):
                    handle.wait()
            for i in list(self._buffers):
                self._free(i)

    @contextlib.contextmanager
    def all_resident(self, dirty: bool) -> Iterator[None]:
        """Every shard in memory (checkpoint save/load: they read and write the masters and state
        as with CPU offload); written back on exit if `dirty`."""
        if self.everything_resident:
            yield
            return
        try:
            for i in range(len(self.shards)):
                self._read(i)
            self._wait(self.reader)
            self.everything_resident = True
            yield
            if dirty:
                for i in range(len(self.shards)):
                    self._write(i)
                self._wait(self.writer)
        finally:
            self.everything_resident = False
            with contextlib.suppress(Exception):
                self.writer.wait()
            for i in list(self._buffers):
                self._free(i)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Read-only access shard by shard (checkpoint save): inside, `hold(i)` makes shard i the one
        in memory (the previous one is dropped: nothing changed it)."""
        if self.everything_resident or self._streaming:
            yield
            return
        self._streaming = True
        try:
            yield
        finally:
            self._streaming = False
            self._release()

    def hold(self, i: int) -> None:
        """Within `streaming`, shard i in memory, and no other (a no-op outside it)."""
        if not self._streaming or self._held == i or i in self._buffers:
            return
        self._release()
        try:
            self._read(i)
            self._held = i
            self._wait(self.reader)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._held is not None:
            with contextlib.suppress(Exception):
                self.reader.wait()
            self._free(self._held)
            self._held = None

    @contextlib.contextmanager
    def shard_resident(self, i: int, dirty: bool) -> Iterator[None]:
        """Shard i in memory (the `safe_get/set_*` accessors); written back on exit if `dirty`."""
        if self.everything_resident or i in self._buffers:
            yield
            return
        try:
            self._read(i)
            self._wait(self.reader)
            yield
            if dirty:
                self._write(i)
                self._wait(self.writer)
        finally:
            with contextlib.suppress(Exception):
                self.writer.wait()
            self._free(i)

    def read_slice(self, i: int, fragment: Any, key: Any, start: int, numel: int,
                   view: "SaveView | None" = None) -> Iterator[torch.Tensor]:
        """Elements [start, start+numel) of shard i's master (`fragment` None) or of state `key` of
        `fragment`, as fp32 chunks of at most CHUNK_BYTES read from its swap file (a checkpoint save
        streaming it: [Note: streamed checkpoint file]), or from memory where the shard is resident.
        With `view` (a background save), the file as it was when the view was taken, always."""
        from ...checkpoint.stream_save import CHUNK_BYTES

        layout = view.layouts[i] if view is not None else self._layouts[i]
        entry = next((e for e in layout if e.fragment is fragment and (fragment is None or e.key == key)), None)
        if entry is None:
            raise KeyError(f"shard {i} of {self._path(i)} holds no {key!r} for that fragment")
        size = torch.empty(0, dtype=entry.dtype).element_size()  # host: element size
        step = max(1, CHUNK_BYTES // size)
        if view is not None:
            fd = view.open(i)
        else:
            fd = None if i in self._buffers else os.open(self._path(i), os.O_RDONLY)
        try:
            for at in range(start, start + numel, step):
                n = min(step, start + numel - at)
                if fd is None:   # resident: the live values
                    live = self.shards[i].master if fragment is None else self.optimizer.state[fragment][key]
                    yield live.reshape(-1)[at:at + n].float()
                    continue
                chunk = torch.empty(n, dtype=entry.dtype, device="cpu")  # host: read from the swap file
                pread_exact(fd, chunk, entry.offset + at * size, self._path(i))
                yield chunk.float()
        finally:
            if fd is not None:
                os.close(fd)

    # --- background checkpoint saves: [Note: swap files under a background save] ---------------------
    def save_view(self) -> "SaveView | None":
        """The swap files as they are now, for a background save to read while training goes on; None
        when a shard is in memory (its file may be stale) or another view is open: then save inline."""
        with self._view_lock:
            if self._buffers or self.everything_resident or self._view is not None:
                return None
            self._view = SaveView(self, [list(layout) for layout in self._layouts])
            return self._view

    def _keep_for_save(self, i: int) -> None:
        """Before shard i's file is overwritten: an open view keeps the current file (renamed aside,
        no copy) and reads it there; the write then creates a new file."""
        with self._view_lock:
            view = self._view
            if view is None or i in view.moved:
                return
            aside = self._path(i) + ".saving"
            try:
                os.rename(self._path(i), aside)
            except FileNotFoundError:   # never written (an empty shard): nothing to keep
                return
            view.moved[i] = aside

    def load_streamed(self, apply: Callable[[int], None]) -> None:
        """A checkpoint load, shard by shard (one in memory at a time): read shard i (its master, and
        state the base optimizer's `load_state_dict` did not replace), `apply(i)` (the checkpoint's
        master values), publish it to the model side, write it back with the loaded state, drop it."""
        for i in range(len(self.shards)):
            try:
                self._read(i, replaced_kept=True)
                self._wait(self.reader)
                apply(i)
                self.shards[i].publish()
                self._write(i)
                self._wait(self.writer)
            finally:
                for handle in (self.reader, self.writer):
                    with contextlib.suppress(Exception):
                        handle.wait()
                self._free(i)

    # --- the step -------------------------------------------------------------------------------
    def _step_shard(self, i: int) -> None:
        """The base optimizer's step on shard i's fragments alone."""
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, self._params_of[i]):
                g["params"] = params
            self.optimizer.step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def step(self) -> None:
        """Update every shard in turn, overlapping I/O with the updates; agreed across ranks."""
        self.wait_s = 0.0

        def run() -> None:
            for i in self.pipelined(dirty=True):
                if any(self._params_of[i]):
                    self._step_shard(i)
                self.shards[i].publish()
        agreed("the optimizer step with offload_optimizer.device nvme", run, RuntimeError, group=self.group)

    def nbytes_on_disk(self) -> int:
        return self.dir.nbytes()

    def close(self) -> None:
        for handle in (self.reader, self.writer):
            with contextlib.suppress(Exception):
                handle.close()
        self.dir.remove()


class SaveView:
    """[Note: swap files under a background save]
    With `checkpoint.async_save` a streamed optimizer file is written by the save's thread while
    training goes on, and the next step rewrites every swap file. The view keeps what the save
    reads: the layouts at the time of the save, and each shard's file as it was then: the first
    write of shard i after the view was taken renames the file aside (`<file>.saving`: no copy, the
    same blocks) and writes a new one, and the view reads the renamed one. Opening a file and the
    rename happen under one lock, so a read sees either file whole, never a mix. `close()` (the
    save written, or abandoned) removes the renamed files; until then they take disk space (at most
    the rank's state once more)."""

    def __init__(self, swapper: OptimizerStateSwapper, layouts: list[list[_Entry]]) -> None:
        self.swapper, self.layouts = swapper, layouts
        self.moved: dict[int, str] = {}   # shard -> its file as of the view, renamed aside

    def open(self, i: int) -> int:
        with self.swapper._view_lock:
            return os.open(self.moved.get(i, self.swapper._path(i)), os.O_RDONLY)

    def close(self) -> None:
        with self.swapper._view_lock:
            if self.swapper._view is self:
                self.swapper._view = None
            moved, self.moved = self.moved, {}
        for path in moved.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def swapper_of(optimizer: Any) -> OptimizerStateSwapper | None:
    return getattr(optimizer, "swapper", None)


def resident(optimizer: Any, dirty: bool) -> Any:
    """For a checkpoint save: the optimizer swapper's `streaming`, or nothing to do without one (a
    load streams in `apply_plan` through `load_streamed`)."""
    swapper = swapper_of(optimizer)
    return swapper.streaming() if swapper is not None and not dirty else contextlib.nullcontext()
