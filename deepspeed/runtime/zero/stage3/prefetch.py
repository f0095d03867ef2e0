"""ZeRO-3 prefetching from a recorded trace: the next units' all-gathers overlap this module's compute.

[Note: ZeRO-3 prefetch trace]
A pass (a forward of the root module, or one backward) acquires units in an order that, for
most models, is the same every step. The trace of a pass kind is the order in which its units
were *first* acquired (forward: pre-forward hooks; backward: pre-backward holds, so roughly the
reverse of forward). The next pass of that kind follows it: whenever a unit is acquired, the
units after it in the trace are prefetched -- asynchronous all-gathers into their flat buffers
(ShardedUnit.prefetch) -- until `prefetch_bucket_size` elements are in flight ahead of it
(DeepSpeed's semantics: the last unit may overshoot; 0 disables prefetching), and only while
the resident elements (gathered or in flight) stay within `max_live_parameters`. The module
that needs a prefetched unit waits for its work instead of issuing a gather, so a stable trace
issues exactly the all-gathers the synchronous path would, in a different order.

The trace is checked, not trusted: each first acquisition must be the next unit of the trace.
On a mismatch (the control flow changed) the trace is dropped, the prefetches in flight are
completed and released (ShardedUnit.drop_prefetch: they were issued on every rank alike, so
waiting for them cannot hang), and the pass's own order becomes the trace at its end. A pass
that ends before its trace does counts as a mismatch too. Every decision depends only on the
trace, the config and the units' states, which are the same on every rank when the ranks run
the same modules -- so the collectives stay matched; when they do not, the watchdog reports it
(watchdog.py). Prefetched collectives are journaled and schedule-checked at issue and bounded by
the same deadline (watchdog.all_gather with start=True).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .sharded_param import ShardedUnit, ZeroParamStatus

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class _Pass:
    """The trace of one pass kind and the progress of the current pass along it."""

    trace: list[int] | None = None             # unit indices, first acquisitions of the last pass
    order: list[int] = field(default_factory=list)   # first acquisitions of the current pass
    seen: set[int] = field(default_factory=set)
    active: bool = False
    cursor: int = 0                            # next expected position in `trace`
    ahead: int = 0                             # next position to consider prefetching


class Prefetcher:
    """Records, checks and follows the forward and backward traces of one coordinator's units."""

    def __init__(self, units: list[ShardedUnit], prefetch_bucket_size: int, max_live_parameters: int) -> None:
        self.units, self.bucket, self.max_live = units, prefetch_bucket_size, max_live_parameters
        self.passes = {FORWARD: _Pass(), BACKWARD: _Pass()}
        self.invalidations = 0
        self.swapper: Any = None   # offload_param nvme: reads shards ahead along the trace (swap_tensor/)

    @property
    def enabled(self) -> bool:
        return self.bucket > 0

    # Upstream's PartitionedParameterCoordinator names, which TRL calls (through
    # `optimizer.parameter_offload.param_coordinator`) after generating without the hooks.
    def is_invalid_trace(self) -> bool:
        """No pass kind has a trace to follow (nothing recorded yet, or dropped)."""
        return all(p.trace is None for p in self.passes.values())

    def _invalidate_trace(self) -> None:
        """Forget the traces: the next pass of each kind records its order anew (no prefetch in it).
        Not counted in `invalidations`, which counts mismatches the check found."""
        for p in self.passes.values():
            p.trace = None
        self._drop_in_flight()

    def begin(self, kind: str) -> None:
        p = self.passes[kind]
        p.active, p.cursor, p.ahead = True, 0, 0
        p.order, p.seen = [], set()
        if self.swapper is not None and p.trace is not None:
            self.swapper.read_ahead(self.units[i] for i in p.trace)

    def end(self, kind: str) -> None:
        """The pass ended: release unused prefetches; keep the trace only if the pass followed it."""
        p = self.passes[kind]
        if not p.active:
            return
        p.active = False
        if p.trace is not None and p.cursor != len(p.trace):
            self._invalidate(p)
        if p.trace is None:
            p.trace = p.order
        self._drop_in_flight()

    def acquired(self, kind: str, unit: ShardedUnit) -> None:
        """`unit` was just acquired (gathered, or its prefetch waited for) in a pass of `kind`."""
        p = self.passes[kind]
        index = unit.spec.index
        if not self.enabled or not p.active or unit.spec.persistent or index in p.seen:
            return
        p.seen.add(index)
        p.order.append(index)
        if p.trace is None:
            return
        if p.cursor >= len(p.trace) or p.trace[p.cursor] != index:
            return self._invalidate(p)
        p.cursor += 1
        if self.swapper is not None:   # shards first: the all-gathers issued next read them
            self.swapper.read_ahead(self.units[i] for i in p.trace[p.cursor:])
        self._prefetch(p, kind)

    def _invalidate(self, p: _Pass) -> None:
        p.trace = None
        self.invalidations += 1
        self._drop_in_flight()

    def _drop_in_flight(self) -> None:
        for unit in self.units:      # unit order: the same on every rank
            unit.drop_prefetch()

    def _prefetch(self, p: _Pass, kind: str) -> None:
        stats = self.units[0].stats
        p.ahead = max(p.ahead, p.cursor)
        issued = 0
        while p.ahead < len(p.trace) and issued < self.bucket:
            unit = self.units[p.trace[p.ahead]]
            if unit.status is ZeroParamStatus.NOT_AVAILABLE:
                if stats.live + unit.spec.numel > self.max_live:
                    return               # retried at the next acquisition, when units were released
                unit.prefetch(f"{kind} prefetch")
                issued += unit.spec.numel
            p.ahead += 1
