"""Counting of every collective the runtime issues: calls, message bytes, wire bytes, time.

`bytes` is the message size (the full logical tensor an op reduces or gathers), which is how
DeepSpeed's comms logger and DDP's bucket sizes are usually quoted. `wire_bytes` is what one
rank sends with a bandwidth-optimal ring: 2(N-1)/N of the message for all_reduce, (N-1)/N for
reduce_scatter and all_gather. Theory claims (DDP and ZeRO-1/2 send 2Ψ(N-1)/N elements per
step, ZeRO-3 3Ψ(N-1)/N) are checked against `wire_bytes`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Fraction of the message one rank puts on the wire, as a function of world size N.
WIRE_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


@dataclass
class OpStats:
    count: int = 0
    numel: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    time_s: float = 0.0


@dataclass
class CommRecord:
    op: str
    numel: int
    nbytes: int
    dtype: str
    world_size: int
    ranks: tuple[int, ...] | None = None   # the group's global ranks (benchmarks split traffic by mesh dim)


@dataclass
class CommsCounter:
    """Process-wide tally of collectives; `reset()` between measured regions."""

    enabled: bool = True
    keep_records: bool = False
    stats: dict[str, OpStats] = field(default_factory=dict)
    records: list[CommRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, op: str, numel: int, nbytes: int, dtype: str, world_size: int, elapsed_s: float,
               ranks: tuple[int, ...] | None = None) -> None:
        if not self.enabled:
            return
        factor = WIRE_FACTOR.get(op, lambda n: 1.0)(max(world_size, 1))
        with self._lock:
            s = self.stats.setdefault(op, OpStats())
            s.count += 1
            s.numel += numel
            s.bytes += nbytes
            s.wire_bytes += nbytes * factor
            s.time_s += elapsed_s
            if self.keep_records:
                self.records.append(CommRecord(op, numel, nbytes, dtype, world_size, ranks))

    def reset(self) -> None:
        with self._lock:
            self.stats.clear()
            self.records.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {count, numel, bytes, wire_bytes, time_s}} as plain numbers."""
        with self._lock:
            return {op: dict(vars(s)) for op, s in self.stats.items()}

    def total(self, key: str = "bytes", ops: tuple[str, ...] | None = None) -> float:
        with self._lock:
            return sum(getattr(s, key) for op, s in self.stats.items() if ops is None or op in ops)


comms_counter = CommsCounter()
