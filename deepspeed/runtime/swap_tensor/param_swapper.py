"""ZeRO-3 parameter shards on NVMe (`offload_param.device: "nvme"`): [Note: parameter swapping].

[Note: parameter swapping]
With parameter offload every ZeRO-3 unit keeps this rank's shard (ShardedUnit.shard) on the host
between uses; with NVMe the shard lives in a file of the run's swap directory ([Note: swap file
ownership]) and at most `max_in_cpu` elements of shards are in memory (reads in flight and
writes not yet finished included; at least one unit's shard, whatever the setting). The tensor
object `unit.shard` is kept: swapped out it is `set_` to a stride-0 view of one NaN with its
shape (no memory; a stray read gives NaN, a stray write raises) and the parameters' `ds_tensor`
views follow it. Every access goes through the unit's `shard` property, which calls `ensure`:
a resident shard is just marked used; one being read is waited for; else room is made and it is
read now. Room is made by evicting the least recently used shards; a shard whose version counter
moved since it was read (the optimizer's publish, a checkpoint load, a write through
`ds_tensor`: views share the counter) is written back first, asynchronously. `fresh` gives a
shard about to be overwritten whole (the optimizer's publish) a buffer without reading it.

Reads ahead follow the ZeRO-3 trace ([Note: ZeRO-3 prefetch trace]): at each acquisition the
prefetcher hands over the units still to come, and the swapper starts reading those that fit in
the budget, in order, so the disk works while the current module computes. One I/O thread runs
the reads and writes in submission order (a read of a shard whose write is queued sees the
written bytes); each request is cut into the handle's parallel chunks.

Faults: a failed read leaves NaN in the buffer and a failed write leaves the shard resident;
either is recorded, and the next agreement point (the end of the root forward, the optimizer
step, a checkpoint save) raises on every rank, naming the failing rank, the file and the cause.
Raising at once would leave the other ranks waiting in the unit's all-gather.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import torch

from ...ops.aio.handle import aio_handle, aligned_host_tensor
from ..agreement import agreed
from .optimizer_swapper import placeholder
from .swap_files import SwapDir


class ParamSwapper:
    """Keeps ZeRO-3 units' shards in files ([Note: parameter swapping])."""

    def __init__(self, units: list[Any], offload: Any, aio: Any, rank: int, group: Any = None) -> None:
        self.units, self.group = units, group
        self.dir = SwapDir(offload.nvme_path, "param", rank)
        self.handle = aio_handle(*aio.handle_args())
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ds-param-swap")
        self.budget = max([int(offload.max_in_cpu)] + [u.layout.shard_numel for u in units])
        self._resident: OrderedDict[Any, int] = OrderedDict()   # unit -> shard version when read (LRU order)
        self._reading: dict[Any, Future] = {}
        self._writing: list[tuple[Future, int]] = []              # (done, elements held until then)
        self.used = 0          # elements of shards in memory (resident, being read, being written)
        self.peak_used = 0
        self.reads = self.writes = self.read_ahead_hits = 0
        self.wait_s = 0.0      # seconds spent waiting on reads (and on writes to make room)
        self.failures: list[str] = []
        for unit in units:     # every shard starts on disk
            unit.attach_swapper(self)
            self._resident[unit] = -1   # dirty: written by the eviction below
            self.used += unit.layout.shard_numel
            self._evict(unit)
            self._drain_writes()

    # --- bookkeeping ----------------------------------------------------------------------------
    def path(self, unit: Any) -> str:
        return self.dir.file(f"unit_{unit.spec.index:05d}.swp")

    def _account(self, delta: int) -> None:
        self.used += delta
        self.peak_used = max(self.peak_used, self.used)

    def _wait(self, future: Future) -> Any:
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def _drain_writes(self, keep: int = 0) -> None:
        """Wait for the oldest writes until at most `keep` are pending; their memory is freed."""
        while len(self._writing) > keep:
            future, numel = self._writing.pop(0)
            with contextlib.suppress(Exception):   # recorded by the write itself
                self._wait(future)
            self._account(-numel)

    def _make_room(self, numel: int, protect: set) -> bool:
        """Free memory until `numel` more elements fit: finished writes, then least recently used
        shards outside `protect`, then reads ahead outside it (finished, then dropped). False when
        nothing more can go."""
        while self.used + numel > self.budget:
            while self._writing and self._writing[0][0].done():
                self._drain_writes(len(self._writing) - 1)
            if self.used + numel <= self.budget:
                break
            victim = next((u for u in self._resident if u not in protect), None)
            if victim is None and not self._writing:
                victim = next((u for u in self._reading if u not in protect), None)
                if victim is not None:
                    self._finish_read(victim)
            if victim is not None:
                self._evict(victim)
            elif self._writing:
                self._drain_writes(len(self._writing) - 1)
            else:
                return False
        return True

    # --- moves ----------------------------------------------------------------------------------
    def _bind(self, unit: Any, tensor: torch.Tensor) -> None:
        unit.bind_shard_storage(tensor)

    def _evict(self, unit: Any) -> None:
        """Out of memory: written back (asynchronously) when it changed since it was read."""
        version = self._resident.pop(unit)
        buffer = unit.raw_shard
        numel = buffer.numel()
        if buffer._version != version and numel:
            self.writes += 1
            data = buffer.detach()   # its own reference: the storage lives until the write is done
            self._writing.append((self._io.submit(self._write_job, data, self.path(unit), unit), numel))
        else:
            self._account(-numel)
        self._bind(unit, placeholder(buffer.shape, buffer.dtype))

    def _write_job(self, data: torch.Tensor, path: str, unit: Any) -> None:
        try:
            self.handle.sync_pwrite(data.view(torch.uint8) if data.dtype != torch.uint8 else data, path, 0)
        except Exception as e:   # noqa: BLE001 - agreed at the next check
            self.failures.append(f"writing the shard of {unit}: {type(e).__name__}: {e}")
            raise

    def _read_job(self, buffer: torch.Tensor, path: str, unit: Any) -> None:
        try:
            self.handle.sync_pread(buffer.view(torch.uint8), path, 0)
        except Exception as e:   # noqa: BLE001 - agreed at the next check
            buffer.fill_(float("nan") if buffer.dtype.is_floating_point else 0)
            self.failures.append(f"reading the shard of {unit}: {type(e).__name__}: {e}")

    def _start(self, unit: Any, read: bool) -> None:
        numel = unit.layout.shard_numel
        buffer = aligned_host_tensor(numel, unit.raw_shard.dtype)
        self._account(numel)
        self._bind(unit, buffer)
        if read and numel:
            self.reads += 1
            self._reading[unit] = self._io.submit(self._read_job, buffer, self.path(unit), unit)
        else:
            self._resident[unit] = buffer._version if read else -1

    def _finish_read(self, unit: Any) -> None:
        self._wait(self._reading.pop(unit))
        self._resident[unit] = unit.raw_shard._version

    # --- the units' side ------------------------------------------------------------------------
    def ensure(self, unit: Any) -> None:
        """`unit`'s shard in memory with its values (read now unless resident or being read)."""
        if unit in self._resident:
            self._resident.move_to_end(unit)
            return
        if unit in self._reading:
            self.read_ahead_hits += 1
        else:
            self._make_room(unit.layout.shard_numel, {unit})
            self._start(unit, read=True)
        if unit in self._reading:
            self._finish_read(unit)

    def fresh(self, unit: Any) -> None:
        """`unit`'s shard in memory, about to be overwritten whole: no read (marked changed)."""
        if unit in self._resident or unit in self._reading:
            self.ensure(unit)
            self._resident[unit] = -1
            return
        self._make_room(unit.layout.shard_numel, {unit})
        self._start(unit, read=False)

    def read_ahead(self, upcoming: Iterable[Any]) -> None:
        """Start reading the next units of the trace that fit in the budget, in order."""
        window, protect = 0, set()
        for unit in upcoming:
            if unit.spec.persistent:
                continue
            window += unit.layout.shard_numel
            if window > self.budget:
                return
            protect.add(unit)
            if unit in self._resident or unit in self._reading:
                continue
            if not self._make_room(unit.layout.shard_numel, protect):
                return
            self._start(unit, read=True)

    def resident_numel(self) -> int:
        """Elements of shards in memory now (tests compare it with the budget)."""
        return sum(u.layout.shard_numel for u in self._resident) + \
            sum(u.layout.shard_numel for u in self._reading) + sum(n for _, n in self._writing)

    def flush(self) -> None:
        """Every changed shard written back and every read finished (checkpoints, tests)."""
        for unit in list(self._reading):
            self._finish_read(unit)
        for unit, version in list(self._resident.items()):
            if unit.raw_shard._version != version:
                self._evict(unit)
        self._drain_writes()

    def check(self, what: str) -> None:
        """Agreed across ranks: raise on every rank if a read or write failed on any."""
        def failed() -> None:
            if self.failures:
                failures, self.failures[:] = list(self.failures), []
                raise OSError(f"offload_param.device nvme: {failures[0]}" +
                              (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
        agreed(what, failed, RuntimeError, group=self.group)

    def nbytes_on_disk(self) -> int:
        return self.dir.nbytes()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._io.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self.handle.close()
        self.dir.remove()


def attach_param_swapper(coordinator: Any, offload: Any, aio: Any, rank: int, group: Any = None) -> ParamSwapper:
    """Put the coordinator's unit shards on NVMe; its prefetcher reads ahead along the trace."""
    swapper = ParamSwapper(coordinator.units, offload, aio, rank, group)
    coordinator.swapper = coordinator.prefetcher.swapper = swapper
    return swapper
