"""UnitGradReducer: reduce-scatters the gradients of complete ZeRO-3 units, small ones in buckets.

[Note: ZeRO-3 reduce-scatter buckets]
One reduce-scatter per unit is right for large units (bandwidth-bound, and the full gradient
is dropped at once), but a model with many small units (LayerNorms, biases, a tiny model)
pays one collective's latency per unit. Units are therefore queued in the order they complete
and reduced together once the queue would exceed `bucket_numel` elements; a unit at least that
large is reduced alone, after the queue. `bucket_cap` sets `bucket_numel`: the config's
`reduce_bucket_size` (DDP's 25 MiB when that is left at DeepSpeed's 5e8 default, as at stages
1-2), but at most max(the largest trained unit, 2^20 elements). The queue then holds little
more gradient than the largest unit's flat gradient, which exists at some point anyway, while
every latency-bound unit still shares a collective: 2^20 elements (4 MB in fp32) is about where
a collective stops being latency-bound (~1-2 ms over gloo/TCP here, ~40 us over NVLink, both
well above the per-call latency). Measured (BENCHMARKS.md): 5M-element buckets on the 19M GPT
(39 units, 5 collectives) were no faster than one collective per unit and raised peak RSS by
~70 MB per rank (20 MB buffers churning glibc's heap); capped at its largest unit (1M) the RSS
came back. The tiny GPT's 15 reduce-scatters become 1. ONE reduce-scatter serves a bucket: every rank's input is the N
rank-slices of the bucket laid side by side,

    input = [u1 slice 0 | u2 slice 0 | ... | u1 slice 1 | u2 slice 1 | ...]   (N x B elements)
    output = [u1 slice r | u2 slice r | ...]                                   (B elements)

so rank r receives exactly its shard of every unit in the bucket (a unit's flat gradient is
already rank-major, N equal slices: see [Note: ZeRO-3 parameter-major shards] in unit_layout.py). What is queued is each unit's
padded flat gradient (its parameters' `.grad` are dropped when queued), so memory waiting in
the queue stays below `bucket_numel` elements. Every rank queues the same units in the same
order (completion is deterministic; see [Note: ZeRO-3 backward]), so buckets match across
ranks; the end of the backward flushes what is left.
"""

from __future__ import annotations

from typing import Any

import torch

from .... import comm as ds_comm
from ...grad_reducer import ReducePolicy
from . import watchdog
from .sharded_param import ShardedUnit
from .units import UnitSpec


LATENCY_BOUND_NUMEL = 1 << 20


def bucket_cap(reduce_bucket_size: int, largest_unit_numel: int) -> int:
    """Elements per bucket; see [Note: ZeRO-3 reduce-scatter buckets]."""
    return min(reduce_bucket_size, max(largest_unit_numel, LATENCY_BOUND_NUMEL))


def bucket_spec(units: list[ShardedUnit]) -> UnitSpec:
    """A unit-like description of a bucket, for the watchdog's schedule checks and messages."""
    owners = [u.spec.owner or "<root>" for u in units]
    return UnitSpec(-1, f"bucket of {len(units)} units: " + ", ".join(owners),
                    tuple(n for u in units for n in u.spec.param_names),
                    tuple(u.partition.padded_numel for u in units), False)


class UnitGradReducer:
    """Reduces queued units' gradients into their `grad_shard`s, one collective per bucket."""

    def __init__(self, group: Any = None, bucket_numel: int = 0, policy: ReducePolicy | None = None,
                 comm_dtype: torch.dtype | None = None, quantized: bool = False) -> None:
        """`bucket_numel` 0: every unit reduced alone, when it completes. `policy`: DeepSpeed's
        prescale_gradients / gradient_predivide_factor (default: sum, then divide by N);
        `comm_dtype`: communication_data_type (default: the parameters' dtype); `quantized`:
        ZeRO++ qgZ, int8 on the wire ([Note: qgZ quantized reduce-scatter] in zero/qgz.py)."""
        self.group, self.bucket_numel, self.quantized = group, bucket_numel, quantized
        self.world = ds_comm.get_world_size(group)
        self.policy = policy if policy is not None else ReducePolicy(self.world)
        self.comm_dtype = comm_dtype
        self._queue: list[tuple[ShardedUnit, torch.Tensor]] = []
        self._queued = 0
        self.collectives = 0   # reduce-scatters issued (tests count them)
        # engine.coalesce_grad_reduction(): unit -> (local fp32 sum of its flat gradients, their dtype)
        self._deferred: dict[ShardedUnit, tuple[torch.Tensor, torch.dtype]] | None = None

    def add(self, unit: ShardedUnit) -> None:
        """`unit`'s gradients are complete: take them (the unit is released) and reduce them now
        or with the next bucket (while deferring: add them to the unit's local sum instead)."""
        flat = unit.take_grads()
        if flat is None:
            return
        if self._deferred is not None:
            held = self._deferred.get(unit)
            if held is None:
                self._deferred[unit] = (flat.float(), flat.dtype)
            else:
                held[0].add_(flat)
            return
        self._enqueue(unit, flat)

    def defer(self) -> None:
        """Keep the gradients of the coming backwards local (summed per unit, in fp32) until
        `flush_deferred`: one reduction for several backwards (coalesce_grad_reduction)."""
        if self._deferred is None:
            self._deferred = {}

    def flush_deferred(self, units: list[ShardedUnit], reduce: bool = True) -> None:
        """Stop deferring; reduce the local sums in `units` order (the same on every rank), in the
        dtype the gradients had, or drop them (`reduce=False`: the block raised)."""
        deferred, self._deferred = self._deferred, None
        if not deferred or not reduce:
            return
        for unit in units:
            if unit in deferred:
                total, dtype = deferred.pop(unit)
                self._enqueue(unit, total.to(dtype))
        self.flush()

    def _enqueue(self, unit: ShardedUnit, flat: torch.Tensor) -> None:
        numel = flat.numel()
        if self._queue and (self._queued + numel > self.bucket_numel or not self._fits(unit, flat)):
            self.flush()
        if numel >= self.bucket_numel:
            self._reduce([(unit, flat)])
        else:
            self._queue.append((unit, flat))
            self._queued += numel

    def _fits(self, unit: ShardedUnit, flat: torch.Tensor) -> bool:
        """A bucket is one tensor: one dtype, device and group ([Note: ZeRO-3 expert units])."""
        first = self._queue[0][1]
        return flat.dtype == first.dtype and flat.device == first.device and self._queue[0][0].group is unit.group

    def discard(self) -> None:
        """Drop queued (and deferred) gradients without reducing them (a backward that failed
        half-way, or zero_grad)."""
        self._queue, self._queued = [], 0
        if self._deferred:
            self._deferred = {}

    def flush(self) -> None:
        """Reduce whatever is queued (end of backward, or the next unit would not fit)."""
        queue, self._queue, self._queued = self._queue, [], 0
        if queue:
            self._reduce(queue)

    def bucket_fill(self) -> dict[torch.dtype, int]:
        """Elements queued for the next reduce-scatter, by dtype (optimizer.report_ipg_memory_usage)."""
        return {self.comm_dtype or self._queue[0][1].dtype: self._queued} if self._queue else {}

    def _reduce(self, items: list[tuple[ShardedUnit, torch.Tensor]]) -> None:
        units = [u for u, _ in items]
        group, world = units[0].group, units[0].world   # one group per bucket (_fits)
        if len(items) == 1:
            flat, spec = items[0][1], units[0].spec
        else:   # rank-major interleave: row r holds every unit's slice r
            flat = torch.cat([f.view(world, -1) for _, f in items], dim=1).view(-1)
            spec = bucket_spec(units)
        if self.comm_dtype is not None and flat.dtype != self.comm_dtype and not self.quantized:
            flat = flat.to(self.comm_dtype)
        before, after = self.policy.before(), self.policy.after()
        if before != 1.0:
            flat.mul_(before)   # our own tensor (take_grads made it)
        out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
        if ds_comm.is_initialized() and self.quantized and world > 1:
            watchdog.quantized_reduce_scatter(out, flat, group, spec, "gradient")
        elif ds_comm.is_initialized():
            watchdog.reduce_scatter(out, flat, group, spec, "gradient")
        else:
            out.copy_(flat)
        self.collectives += 1
        offset = 0
        for unit in units:
            n = unit.partition.shard_numel
            unit.add_reduced(out[offset:offset + n], after)
            offset += n
