"""No silent hangs: ZeRO-3's unit collectives are bounded in time and checked across ranks.

[Note: ZeRO-3 divergence]
Every rank must issue the same unit collectives in the same order (units.py); a model whose
forward runs different modules on different ranks breaks that. One rank then issues an
all-gather that pairs with another unit's collective on the other ranks: of the same size, the
result is silently wrong; of another size, gloo aborts the receiving process ("Received data
size doesn't match expected size") and NCCL hangs or corrupts; an unpaired last collective
waits for the backend timeout (30 minutes). Three mechanisms, cheapest first:

1. Deadline (always): each unit collective carries its own timeout, DEEPSPEED_ZERO3_TIMEOUT_S
   (default 300 s), see comm/bounded.py. A collective that fails -- timed out, or its peer
   gone -- ends in a report instead of the backend's message.
2. Schedule check (every DEEPSPEED_ZERO3_CHECK_EVERY unit collectives, default 64; 0 = off):
   each rank keeps a running hash of its sequence of (operation, unit), posts (position, hash)
   in the c10d store that torch.distributed already uses for rendezvous, and compares the
   latest post of its neighbour (group rank + 1) with its own hash at that position. Nothing is
   waited for: the neighbour made its previous post before joining a collective this rank has
   completed since, so a post is there. No collective is added: the normal path stays one
   collective per unit. This catches the silent case (same sizes) within 2 x CHECK_EVERY
   collectives.
3. Strict (DEEPSPEED_ZERO3_STRICT=1, off by default): before each unit collective the ranks
   all-gather a fingerprint (position, unit, size, operation; 4 int64); on a difference every
   rank raises before the data collective is issued, so nothing pairs wrongly and no process
   aborts. Costs one small collective per unit collective (latency-bound; see docs/zero.md).

A rank that fails posts a report (its position and latest collectives) in the store, sets an
abort flag there, breaks the group (comm/bounded.py `break_group`: with gloo it closes this
rank's connections, so a peer's collective waiting on this rank fails at once), gathers the
reports that arrive within min(timeout, 10 s) and raises ZeRO3DivergenceError naming its unit,
the other ranks' units, the first position where the sequences differ and the leaf-module
remedy. The others fail the same way -- their collective failed (at once when it waits on a
failed rank, else at its deadline) or their check saw the flag -- so every rank that keeps
running ZeRO-3 collectives raises within timeout + 10 s. The process group is unusable
afterwards. Settings come from the environment at import (`configure()` changes them).
A prefetch (`all_gather(..., start=True)`, and qwZ's likewise) is journaled, checked and counted when
issued -- issue order is what pairs collectives -- and its `finish()` fails like a synchronous
collective would, naming the unit and the phase ("forward prefetch").

Every collective, these included, is also journaled by deepspeed.comm's guard ([Note: collective
guard] in comm/guard.py), which names ranks stuck in different collectives of any kind (a unit
reduce-scatter on one rank, the optimizer's gradient-norm all-reduce on another) after
DEEPSPEED_COMM_GUARD_S, usually before this deadline. Unit collectives carry their `Site` as the
guard's label; this module's report is posted to the guard too (`announce`), so that a rank whose
failing collective is not a unit collective raises with it instead of the backend's message.
"""

from __future__ import annotations

import json
import os
import time
import weakref
import zlib
from collections import deque
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as _tdist

from .... import comm as ds_comm
from ....comm.guard import CollectiveDivergenceError, announce, pass_through
from ....comm.bounded import (all_gather_into_tensor_within, break_group, reduce_scatter_tensor_within,
                              start_all_gather_into_tensor_within)
from .units import UnitSpec

TIMEOUT_ENV, CHECK_ENV = "DEEPSPEED_ZERO3_TIMEOUT_S", "DEEPSPEED_ZERO3_CHECK_EVERY"
STRICT_ENV = "DEEPSPEED_ZERO3_STRICT"
DEFAULT_TIMEOUT_S, DEFAULT_CHECK_EVERY = 300.0, 64
_JOURNAL, _LISTED_RANKS = 256, 8
_MASK = (1 << 63) - 1
_OPS = {"all-gather": 1, "reduce-scatter": 2}

LEAF_HINT = ("Under ZeRO-3 every rank must run the same modules in the same order: each module's parameters "
             "are gathered (and its gradients reduced) by a collective of all ranks. If a module's forward "
             "runs submodules depending on the data (mixture-of-experts routing, an `if` on the input), make it "
             "a ZeRO-3 leaf module, gathered whole on every rank: "
             "deepspeed.utils.set_z3_leaf_modules(model, [ItsClass]) or the config section "
             "\"zero_optimization\": {\"leaf_module\": {\"classes\": [\"ItsClass\"]}} (or \"names\").")


pass_through(__file__)   # a unit collective's report names who asked for the unit, not this module


class ZeRO3DivergenceError(CollectiveDivergenceError):
    """Ranks issued different ZeRO-3 collectives, or one of them did not complete in time."""


def _from_env(name: str, default: Any, kind: type) -> Any:
    try:
        return kind(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not a valid {kind.__name__}") from None


@dataclass(frozen=True)
class Settings:
    """Read from the environment at import; `configure()` overrides them in a running process."""

    timeout_s: float = _from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float)
    check_every: int = _from_env(CHECK_ENV, DEFAULT_CHECK_EVERY, int)
    strict: bool = os.environ.get(STRICT_ENV, "0").lower() not in ("", "0", "false", "no")


SETTINGS = Settings()


def configure(**changes: Any) -> Settings:
    """Change the settings (timeout_s, check_every, strict); returns the previous ones. Every rank
    must use the same check_every and strict."""
    global SETTINGS
    previous, SETTINGS = SETTINGS, replace(SETTINGS, **changes)
    return previous


@dataclass(frozen=True)
class Site:
    """What one unit collective is: the operation, the unit, and what the rank was doing."""

    op: str                    # "all-gather" | "reduce-scatter"
    phase: str                 # "forward", "backward", "gradient", ...
    owner: str
    params: tuple[str, ...]
    numel: int
    token: int                 # the same on every rank for the same operation on the same unit

    def describe(self) -> str:
        names = ", ".join(self.params[:6]) + (f", ... ({len(self.params)} in all)" if len(self.params) > 6 else "")
        return (f"{self.phase} {self.op} of module '{self.owner or '<root>'}' "
                f"(parameters {names}; {self.numel} elements)")


@lru_cache(maxsize=8192)
def site(op: str, phase: str, spec: UnitSpec) -> Site:
    token = zlib.crc32(f"{op}|{spec.owner}|{','.join(spec.param_names)}|{spec.numels}".encode())
    return Site(op, phase, spec.owner, spec.param_names, spec.numel, token)


def _encode(entries: list[tuple[int, Site]]) -> dict:
    """Entries as JSON-able data another rank can describe without knowing our units."""
    labels = list(dict.fromkeys(s.describe() for _, s in entries))
    index = {label: i for i, label in enumerate(labels)}
    return {"labels": labels, "journal": [[q, s.token, index[s.describe()]] for q, s in entries]}


def _decode(posted: dict) -> dict[int, tuple[int, str]]:
    """seq -> (token, description) of a posted journal."""
    labels = posted.get("labels", [])
    return {q: (t, labels[i] if i < len(labels) else f"unit collective {t:#x}")
            for q, t, i in posted.get("journal", [])}


class _GroupWatch:
    """Journal and checks of the unit collectives of one process group in this process."""

    def __init__(self, group: Any) -> None:
        pg = group if group is not None else _tdist.distributed_c10d._get_default_group()
        self.group, self.rank, self.world = group, ds_comm.get_rank(group), ds_comm.get_world_size(group)
        self.prefix = f"deepspeed/zero3/{getattr(pg, 'group_name', '') or 'default'}"
        self.seq, self.hash, self.last_check = 0, 0, 0
        self.journal: deque[tuple[int, Site]] = deque(maxlen=_JOURNAL)
        self.hashes: dict[int, int] = {}     # running hash at the latest check positions

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # --- the three mechanisms ---------------------------------------------------------------
    def run(self, s: Site, device: torch.device, call: Callable[[float, Any], Any]) -> Any:
        """Journal, (strict) verify, issue `call(timeout)`, check the schedule; returns call's
        result. An asynchronous call is journaled here, at issue: issue order is what must match."""
        settings = SETTINGS
        self.seq += 1
        seq = self.seq
        self.journal.append((seq, s))
        self.hash = ((self.hash * 1099511628211) ^ s.token) & _MASK
        if settings.strict:
            self._verify(seq, s, device, settings.timeout_s)
        result = self.guard(seq, s, lambda: call(settings.timeout_s, s))
        if settings.check_every > 0 and seq % settings.check_every == 0:
            self._check_schedule(seq, s)
        return result

    def guard(self, seq: int, s: Site, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except CollectiveDivergenceError:
            raise                    # diagnosed already, by deepspeed.comm's guard (comm/guard.py)
        except RuntimeError as exc:  # a backend error or timeout: every cause ends in the same report
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.fail(seq, s, f"the collective failed ({first})", cause=exc)

    def _verify(self, seq: int, s: Site, device: torch.device, timeout: float) -> None:
        mine = torch.tensor([seq, s.token, s.numel, _OPS[s.op]], dtype=torch.int64, device=device)
        rows = torch.empty(self.world * 4, dtype=torch.int64, device=device)
        try:
            all_gather_into_tensor_within(rows, mine, timeout, self.group, label="strict-mode fingerprint")
        except CollectiveDivergenceError:
            raise
        except RuntimeError as exc:
            self.fail(seq, s, f"the fingerprint all-gather before it failed ({str(exc).strip()[:200]})", cause=exc)
        table = rows.view(self.world, 4).tolist()
        others = [r for r, row in enumerate(table) if row != table[self.rank]]
        if others:
            self.fail(seq, s, f"rank(s) {others} are about to issue a different collective at this position "
                              f"(checked before issuing it, {STRICT_ENV}=1)")

    def _check_schedule(self, seq: int, s: Site) -> None:
        self.hashes[seq] = self.hash
        for old in sorted(self.hashes)[:-4]:
            del self.hashes[old]
        neighbour = (self.rank + 1) % self.world
        try:
            store = _store()
            store.set(self._key("schedule", self.rank), json.dumps({"seq": seq, "hash": self.hash}))
            aborted = store.check([self._key("abort")])
            key = self._key("schedule", neighbour)
            posted = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:   # no store to compare through: the deadline still bounds every wait
            return
        self.last_check = seq
        if aborted:
            self.fail(seq, s, "another rank found that the ranks' ZeRO-3 collectives differ")
        if posted is not None and self.hashes.get(posted["seq"], posted["hash"]) != posted["hash"]:
            self.fail(seq, s, f"the sequence of ZeRO-3 collectives up to #{posted['seq']} differs between this "
                              f"rank and rank {neighbour} (schedule check every {SETTINGS.check_every} collectives)")

    # --- the report -------------------------------------------------------------------------
    def fail(self, seq: int, s: Site, reason: str, cause: BaseException | None = None) -> NoReturn:
        # the collectives since two checks ago: where a difference not found yet can lie
        recent = list(self.journal)[-max(24, 2 * SETTINGS.check_every):]
        reports: dict[int, dict] = {}
        note = ""
        try:
            store = _store()
            report = {"seq": seq, "current": s.describe(), **_encode(recent)}
            store.set(self._key("report", self.rank), json.dumps(report))
            store.set(self._key("abort"), reason)
            announce(self.group, f"rank {self.rank}: ZeRO-3: {reason}, at unit collective #{seq}, the {s.describe()}",
                     owner=__name__)
            break_group(self.group)     # the other ranks' collectives fail now, not at their deadline
            deadline = time.monotonic() + min(SETTINGS.timeout_s, 10.0)
            pending = [r for r in range(self.world) if r != self.rank]
            while True:
                for r in [r for r in pending if store.check([self._key("report", r)])]:
                    reports[r] = json.loads(store.get(self._key("report", r)))
                    pending.remove(r)
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception as exc:  # the store's host may be the rank that died
            note = f"\n(the other ranks' reports could not be read: {str(exc).strip()[:200]})"
        raise ZeRO3DivergenceError(self._message(seq, s, reason, reports) + note) from cause

    def _message(self, seq: int, s: Site, reason: str, reports: dict[int, dict]) -> str:
        lines = [f"ZeRO-3: rank {self.rank} of {self.world} stopped at unit collective #{seq}, the {s.describe()}: "
                 f"{reason}. Timeout per collective: {SETTINGS.timeout_s:g} s ({TIMEOUT_ENV})."]
        mine = {q: (e.token, e.describe()) for q, e in self.journal}
        first: tuple[int, int, str, str] | None = None
        for r in sorted(reports)[:_LISTED_RANKS]:
            theirs = _decode(reports[r])
            where = reports[r].get("seq", max(theirs, default=0))
            current = reports[r].get("current") or (theirs[where][1] if where in theirs else "?")
            lines.append(f"  rank {r}: at unit collective #{where}, the {current}")
            for q in sorted(set(theirs) & set(mine)):
                if theirs[q][0] != mine[q][0]:
                    if first is None or q < first[0]:
                        first = (q, r, mine[q][1], theirs[q][1])
                    break
        silent = [r for r in range(self.world) if r != self.rank and r not in reports]
        if silent:
            more = " ..." if len(silent) > _LISTED_RANKS else ""
            lines.append(f"  no report from rank(s) {silent[:_LISTED_RANKS]}{more} "
                         f"(still computing, finished, or dead)")
        if first is not None:
            q, r, here, there = first
            lines.append(f"First difference at unit collective #{q}: on this rank the {here}; on rank {r} the {there}.")
        lines.append(LEAF_HINT)
        return "\n".join(lines)


# Weak keys: a destroyed group is freed (its gloo workers joined), not kept alive by its journal.
_WATCHES: "weakref.WeakKeyDictionary[Any, _GroupWatch]" = weakref.WeakKeyDictionary()


def _store() -> Any:
    return _tdist.distributed_c10d._get_default_store()


def _watch(group: Any) -> _GroupWatch:
    key = group if group is not None else _tdist.distributed_c10d._get_default_group()
    watch = _WATCHES.get(key)
    if watch is None:
        watch = _WATCHES[key] = _GroupWatch(group)
    return watch


def _unit_collective(op: str, phase: str, spec: UnitSpec, group: Any, device: torch.device,
                     call: Callable[[float, Any], Any]) -> Any:
    watch = _watch(group)
    if watch.world == 1:
        return call(SETTINGS.timeout_s, None)
    return watch.run(site(op, phase, spec), device, call)


def _gather(out: torch.Tensor, shard: torch.Tensor, group: Any, spec: UnitSpec, phase: str, start: bool,
            call: Callable[[float, Any], Any]) -> "PendingGather | None":
    """Issue a unit all-gather `call(timeout, site)`: waited for here, or (`start`) left running and
    returned as a PendingGather. Either way journaled, checked and counted now: issue order is
    what pairs collectives across ranks."""
    work = _unit_collective("all-gather", phase, spec, group, out.device, call)
    if not start:
        return None
    watch = _watch(group)
    return PendingGather(work, watch if watch.world > 1 else None, watch.seq, site("all-gather", phase, spec),
                         (out, shard))


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, spec: UnitSpec, phase: str,
               start: bool = False) -> "PendingGather | None":
    """The unit's one all-gather, bounded and checked; see [Note: ZeRO-3 divergence]. `start`: issue
    it asynchronously (a prefetch) and return its PendingGather; bounded by the same deadline,
    which the operation carries."""
    gather = start_all_gather_into_tensor_within if start else all_gather_into_tensor_within
    return _gather(out, shard, group, spec, phase, start, lambda t, s: gather(out, shard, t, group, label=s))


class PendingGather:
    """An issued asynchronous unit all-gather; `finish()` waits for it (bounded by the deadline the
    operation carries), reports a failure like a synchronous collective would, then runs the steps
    added with `then` (unpacking, dequantising) in order."""

    def __init__(self, work: Any, watch: "_GroupWatch | None", seq: int, s: Site | None, inputs: Any) -> None:
        self.work, self.watch, self.seq, self.site = work, watch, seq, s
        self.inputs = inputs   # the output and shard stay alive until the backend is done with them
        self._then: list[Callable[[], None]] = []

    def then(self, step: Callable[[], None]) -> "PendingGather":
        self._then.append(step)
        return self

    def finish(self) -> None:
        work, self.work, self.inputs = self.work, None, None
        if work is not None:
            if self.watch is None:
                work.wait()
            else:
                self.watch.guard(self.seq, self.site, work.wait)
        steps, self._then = self._then, []
        for step in steps:
            step()


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Any, spec: UnitSpec, phase: str) -> None:
    """The unit's one reduce-scatter, bounded and checked; see [Note: ZeRO-3 divergence]."""
    _unit_collective("reduce-scatter", phase, spec, group, out.device,
                     lambda t, s: reduce_scatter_tensor_within(out, flat, t, group, label=s))


def quantized_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Any, spec: UnitSpec, phase: str) -> None:
    """The unit's reduce-scatter as qgZ's int8 all-to-all (zero/qgz.py), bounded and checked like it."""
    from ..qgz import quantized_reduce_scatter as exchange

    _unit_collective("reduce-scatter", phase, spec, group, out.device,
                     lambda t, s: exchange(out, flat, group, t, label=s))


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, spec: UnitSpec, phase: str,
                         start: bool = False) -> "PendingGather | None":
    """The unit's all-gather as qwZ's int8 one (zero/qwz.py), bounded and checked like it; `start`
    as `all_gather` (the dequantisation runs at `finish()`)."""
    from ..qwz import quantized_all_gather as exchange

    return _gather(out, shard, group, spec, phase, start,
                   lambda t, s: exchange(out, shard, group, t, label=s, start=start))


def gather_or_copy(out: torch.Tensor, shard: torch.Tensor, group: Any, spec: UnitSpec | None = None,
                   phase: str = "", start: bool = False) -> "PendingGather | None":
    """All-gather through deepspeed.comm (counted); a plain copy in a process without a group.
    A unit's collective (`spec` given) is bounded in time and checked across ranks: see
    [Note: ZeRO-3 divergence]. `start` (a unit's only): asynchronous, see `all_gather`."""
    if not ds_comm.is_initialized():
        out.copy_(shard)
        return PendingGather(None, None, 0, None, None) if start else None
    if spec is not None:
        return all_gather(out, shard, group, spec, phase, start)
    if start:
        raise ValueError("gather_or_copy: only a unit's all-gather (spec given) is started asynchronously")
    ds_comm.all_gather_into_tensor(out, shard, group=group)
    return None
