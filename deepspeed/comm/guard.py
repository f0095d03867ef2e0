"""Every collective of deepspeed.comm is journaled; ranks stuck in different collectives are named.

[Note: collective guard]
Ranks must issue the same collectives in the same order. A program that diverges (one rank skips
or repeats `engine.backward`, skips `engine.step`, runs another number of micro-batches) pairs
a collective of one rank with a different one of the others: they wait for each other until the
backend's timeout (30 minutes), or one of them fails with the backend's message ("Connection
closed by peer ... GLHF!") that says nothing about why. Every collective of the runtime goes
through `deepspeed.comm` (comm.py `_timed`), so the guard sits there, once, for all of them:
gradient norms, overflow and step agreement, the reducer's buckets at every ZeRO stage, ZeRO-3's
unit collectives, checkpoint agreement. Point-to-point operations (pipeline sends) are not
ordered per group and are not journaled.

On the calling thread (the only per-collective cost, about a microsecond): each group's
`Ledger` numbers its collectives (#1, #2, ... the same on every rank of a correct program) and
keeps the last `_JOURNAL` of them: operation, element count and dtype, and where it was issued
(the first frame outside deepspeed/comm, plus a label such as ZeRO-3's unit description).
Nothing else: no extra collective, no store access.

On a daemon thread, every `tick_s`: a rank whose oldest unfinished collective has been pending
for `DEEPSPEED_COMM_GUARD_S` seconds (default 30; 0 = off) posts its state -- that collective,
the last ones before it, and the issuing thread's stack -- in the c10d store that rendezvous
already uses, and reads the other ranks' posts. When every rank of the group is stuck and they
are not all stuck in the same collective (number, operation, size), no rank can ever proceed:
once two consecutive ticks agree, the rank posts the report under the group's `abort` key and
breaks the group (comm/breaker.py), so every rank's pending collective fails at once. A slow
rank (computing, not in a collective) posts nothing, and the others keep waiting: only a
certain deadlock is reported.

A collective that fails (broken by a diagnosis, a peer that exited or crashed, a ZeRO-3
deadline) raises `CollectiveDivergenceError` with the diagnosis when there is one -- this
rank's, another rank's `abort` post (ZeRO-3's watchdog posts its report there too, `announce`),
or a peer's `exited` post (comm/exit.py posts each rank's last collective when it exits; rank 0,
the store's host, keeps the store up until the others have posted theirs) -- so every rank
tells the same story, whichever of them the launcher shows first. The failure can come before
the diagnosis (gloo closes a timed-out operation's connections before its rank has written why),
so a failing rank waits up to 2 s for one. Without a diagnosis the backend's error stays, with a
note naming the collective this rank was in.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as _tdist

from .breaker import break_now, breakable

GUARD_ENV = "DEEPSPEED_COMM_GUARD_S"
DEFAULT_GUARD_S = 30.0
_JOURNAL = 64          # collectives kept per group (and compared in a report)
_POSTED = 12           # of which a post carries the latest
_STACK = 8             # frames of the issuing thread in a post
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_COMM_DIR))
# Operations whose element count must be the same on every rank (the others: per-rank sizes;
# the list forms all_gather/reduce_scatter may carry uneven pieces, so their sizes are not compared).
_SIZED = frozenset({"all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "gather", "scatter"})
_UNORDERED = frozenset({"send", "recv", "isend", "irecv"})

HINT = ("Every rank must issue the same collectives in the same order: a rank that skips or repeats "
        "engine.backward() or engine.step(), runs a different number of micro-batches, or takes a "
        "data-dependent branch around a collective pairs its collectives with different ones on the others.")


class CollectiveDivergenceError(RuntimeError):
    """Ranks issued different collectives (or one of them stopped issuing them)."""


def _env_seconds() -> float:
    raw = os.environ.get(GUARD_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_GUARD_S
    except ValueError:
        raise ValueError(f"{GUARD_ENV}={raw!r}: expected a number of seconds (0 turns the guard off)") from None


@dataclass(frozen=True)
class Settings:
    """`stuck_s`: how long a collective may stay pending before the ranks compare; 0 = off."""

    stuck_s: float = _env_seconds()

    @property
    def tick_s(self) -> float:
        return min(max(self.stuck_s / 2, 0.1), 5.0)


SETTINGS = Settings()


def configure(**changes: Any) -> Settings:
    """Change the settings in a running process (tests); returns the previous ones."""
    global SETTINGS
    previous, SETTINGS = SETTINGS, replace(SETTINGS, **changes)
    _Watcher.wake()
    return previous


class Entry:
    """One issued collective. Written by the issuing thread; read by the watcher."""

    __slots__ = ("seq", "op", "numel", "dtype", "code", "line", "label", "thread", "issued", "done", "work")

    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "") if self.dtype is not None else "-"

    def signature(self) -> list:
        return [self.seq, self.op, self.numel if self.op in _SIZED else -1, self.dtype_name()]

    def what(self) -> str:
        size = f" of {self.numel} {self.dtype_name()} element{'s' if self.numel > 1 else ''}" if self.numel else ""
        label = self.label.describe() if hasattr(self.label, "describe") else self.label
        where = f"{self.code.co_qualname} ({_short(self.code.co_filename)}:{self.line})" if self.code else "?"
        return f"{self.op}{size}" + (f", the {label}," if label else "") + f" issued in {where}"

    def pending(self) -> bool:
        if self.done:
            return False
        if self.work is None:
            return True                      # a synchronous call still in flight
        work = self.work()
        return work is not None and not work.finished()


def _short(path: str) -> str:
    return os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path


_PASS_THROUGH: set[str] = set()   # modules that only forward a labelled collective (ZeRO-3's watchdog)


def pass_through(path: str) -> None:
    """Name a module whose frames are skipped when finding who issued a collective."""
    _PASS_THROUGH.add(path)


def _site() -> tuple[Any, int]:
    """The first frame outside deepspeed/comm (and pass-through modules): who issued the collective."""
    frame = sys._getframe(3)
    while frame is not None and (frame.f_code.co_filename.startswith(_COMM_DIR)
                                 or frame.f_code.co_filename in _PASS_THROUGH):
        frame = frame.f_back
    return (frame.f_code, frame.f_lineno) if frame is not None else (None, 0)


class Ledger:
    """The journal of one process group's collectives in this process (one owner: this module)."""

    def __init__(self, pg: Any) -> None:
        self.pg, self.pid = weakref.ref(pg), os.getpid()
        self.rank, self.world = pg.rank(), pg.size()
        self.ranks = _tdist.get_process_group_ranks(pg)
        self.name = getattr(pg, "group_name", "") or "default"
        self.seq = 0
        self.journal: deque[Entry] = deque(maxlen=_JOURNAL)
        self.posted = False
        self.seen: Any = None          # the last snapshot of posts (a report needs two alike)
        self.failure: str | None = None

    def key(self, *parts: Any) -> str:
        return "/".join(["deepspeed/comm", self.name, *map(str, parts)])

    def begin(self, op: str, tensor: Any, label: Any) -> Entry:
        entry = Entry()
        self.seq += 1
        entry.seq, entry.op, entry.label = self.seq, op, label
        entry.numel, entry.dtype = (tensor.numel(), tensor.dtype) if tensor is not None else (0, None)
        entry.code, entry.line = _site()
        entry.thread, entry.issued, entry.done, entry.work = threading.get_ident(), time.monotonic(), False, None
        self.journal.append(entry)
        return entry

    # --- the watcher's side --------------------------------------------------------------------
    def oldest_pending(self) -> Entry | None:
        for entry in list(self.journal):
            if entry.pending():
                return entry
        return None

    def state(self, entry: Entry, now: float) -> dict:
        frame = sys._current_frames().get(entry.thread)
        stack = _stack(frame) if frame is not None else []
        del frame
        recent = [e for e in list(self.journal) if e.seq <= entry.seq][-_POSTED:]
        return {"rank": self.ranks[self.rank], "state": "stuck", "seq": entry.seq, "sig": entry.signature(),
                "what": entry.what(), "waited_s": round(now - entry.issued, 1), "stack": stack,
                "journal": [[e.seq, e.op, e.signature()[2], _label(e), e.what()] for e in recent]}

    def tick(self, store: Any, now: float) -> None:
        entry = self.oldest_pending()
        if entry is None or now - entry.issued < SETTINGS.stuck_s or self.failure is not None:
            if self.posted and self.failure is None:   # no longer stuck there: a stale post would mislead
                # overwritten, never deleted: a peer between its check() and get() would block in get()
                store.set(self.key("state", self.rank), "null")
                self.posted, self.seen = False, None
            return
        mine = self.state(entry, now)
        store.set(self.key("state", self.rank), json.dumps(mine))
        self.posted = True
        peers = _read(store, [self.key("state", r) for r in range(self.world) if r != self.rank])
        if any(p is None for p in peers):
            self.seen = None                 # a rank is computing (or dead): nothing is certain yet
            return
        states = sorted([mine, *peers], key=lambda s: s["rank"])
        exited = [s for s in peers if s["state"] == "exited"]
        if not exited and all(s["sig"] == mine["sig"] for s in peers):
            return                           # all in the same collective: slow, not diverged
        snapshot = [(s["rank"], s["state"], s.get("sig")) for s in states]
        if not exited and snapshot != self.seen:
            self.seen = snapshot             # confirm on the next tick: a post may be a moment old
            return
        if store.check([self.key("abort")]):
            self.failure = json.loads(store.get(self.key("abort")))["message"]
        else:
            self.failure = report(self, states)
            store.set(self.key("abort"), json.dumps({"rank": mine["rank"], "message": self.failure}))
        pg = self.pg()
        if pg is not None and breakable(pg):
            break_now(pg)                    # every rank's pending collective fails now


def _stack(frame: Any) -> list[str]:
    """The issuing thread's calls outside deepspeed/comm and torch, innermost last: the runtime's
    call site and, first, the user's line that led to it."""
    frames = [f for f in traceback.extract_stack(frame)
              if not f.filename.startswith(_COMM_DIR) and f"{os.sep}torch{os.sep}" not in f.filename]
    return [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames[-_STACK:]]


def _label(entry: Entry) -> str:
    label = entry.label.describe() if hasattr(entry.label, "describe") else entry.label
    return f"{entry.op} {label or (entry.code.co_qualname if entry.code else '')}"


def _read(store: Any, keys: list[str]) -> list[dict | None]:
    """Each key's post, None where none is (a withdrawn post reads "null"). Posts are never
    deleted, so a key that check() finds is still there for get()."""
    return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]


def report(ledger: Ledger, states: list[dict]) -> str:
    """The message every rank raises: who waits in what, and where the journals first differ."""
    exited = [s["rank"] for s in states if s["state"] == "exited"]
    waiting = [s["rank"] for s in states if s["state"] != "exited"]
    failed = [s["rank"] for s in states if s["state"] == "exited" and s.get("error")]
    if failed:
        why = (f"rank(s) {failed} exited on an error (see their own output) while rank(s) {waiting} waited "
               f"in a collective.")
    elif exited:
        why = (f"rank(s) {waiting} wait in a collective that rank(s) {exited} will never issue: "
               f"{'they' if len(exited) > 1 else 'it'} exited first.")
    else:
        why = "they wait in different collectives, so none of them can proceed."
    verb = "stopped" if failed else "diverged"
    lines = [f"deepspeed.comm: the ranks of process group '{ledger.name}' ({ledger.world} ranks) {verb}: {why}"]
    for s in states:
        if s["state"] == "exited":
            lines.append(f"  rank {s['rank']}: exited{' on an error' if s.get('error') else ''} after its "
                         f"collective #{s['seq']}" + (f", the {s['what']}" if s.get("what") else ""))
            continue
        lines.append(f"  rank {s['rank']}: waits {s['waited_s']} s in collective #{s['seq']}, {s['what']}")
        if s["stack"]:
            lines.append("    called from " + " -> ".join(s["stack"][-4:]))
    first = _first_difference(states, min((s["seq"] for s in states if s["state"] != "exited"), default=0))
    if first:
        lines.append(first)
    if not failed:
        lines.append(HINT + f" (Checked after {SETTINGS.stuck_s:g} s in a collective: {GUARD_ENV}.)")
    return "\n".join(lines)


def _first_difference(states: list[dict], stuck: int) -> str:
    """Where the journals first differ, when that is before the collective the ranks are stuck in."""
    journals = {s["rank"]: {q: (op_label, what) for q, _op, _n, op_label, what in s.get("journal", [])}
                for s in states}
    common = set.intersection(*(set(j) for j in journals.values())) if journals else set()
    for q in sorted(q for q in common if q < stuck):
        labels = {r: j[q] for r, j in journals.items()}
        if len({v[0] for v in labels.values()}) > 1:
            parts = "; ".join(f"rank {r}: {w}" for r, (_, w) in sorted(labels.items()))
            return f"  first difference at collective #{q}: {parts}"
    return ""


# --- the watcher thread --------------------------------------------------------------------------
class _Watcher:
    """One daemon thread per process, started with the first guarded collective."""

    thread: threading.Thread | None = None
    event = threading.Event()
    stopped = False

    @classmethod
    def ensure(cls) -> None:
        if cls.thread is None and not cls.stopped:
            cls.thread = threading.Thread(target=cls.run, name="deepspeed-comm-guard", daemon=True)
            cls.thread.start()

    @classmethod
    def wake(cls) -> None:
        cls.event.set()

    @classmethod
    def stop(cls) -> None:
        cls.stopped = True
        cls.event.set()
        if cls.thread is not None and cls.thread is not threading.current_thread():
            cls.thread.join(timeout=2.0)

    @classmethod
    def run(cls) -> None:
        store = None
        while not cls.stopped:
            cls.event.wait(SETTINGS.tick_s)
            cls.event.clear()
            if cls.stopped or SETTINGS.stuck_s <= 0:
                continue
            try:
                store = store or _own_store()
                now = time.monotonic()
                for ledger in list(_LEDGERS.values()):
                    ledger.tick(store, now)
            except Exception:   # the store's host may be gone: the backend's own errors remain
                store = None


def _own_store() -> Any:
    """A connection of our own to the rendezvous store (the main thread may use the default one)."""
    store = _tdist.distributed_c10d._get_default_store()
    try:
        return store.clone()
    except Exception:
        return store


# --- the issuing thread's side -------------------------------------------------------------------
_LEDGERS: "weakref.WeakKeyDictionary[Any, Ledger]" = weakref.WeakKeyDictionary()


class _World:
    book: Ledger | None = None     # the default group's ledger: the common case, looked up first


def ledger(group: Any) -> Ledger | None:
    """The group's ledger, or None where nothing is guarded (off, one rank, not initialised)."""
    if SETTINGS.stuck_s <= 0:
        return None
    if group is None:
        book = _World.book
        if book is not None and book.pg() is not None:
            return book
    elif not hasattr(group, "rank"):
        return None                  # not a process group: a rank outside it (torch's NON_GROUP_MEMBER)
    elif (book := _LEDGERS.get(group)) is not None:
        return book
    if not _tdist.is_initialized():
        return None
    pg = group if group is not None else _tdist.GroupMember.WORLD
    found = _LEDGERS.get(pg)
    if found is None:
        if pg is None or pg.size() < 2:
            return None
        found = _LEDGERS[pg] = Ledger(pg)
        _Watcher.ensure()
    if group is None:
        _World.book = found
    return found


def forget(group: Any) -> None:
    """The group is being destroyed: its ledger goes (a new default group starts a new one)."""
    pg = group if group is not None else _tdist.GroupMember.WORLD
    if pg is not None:
        _LEDGERS.pop(pg, None)
    if group is None or (_World.book is not None and _World.book.pg() is pg):
        _World.book = None


def begin(op: str, tensor: Any, group: Any, label: Any = None) -> Entry | None:
    if op in _UNORDERED:
        return None
    book = ledger(group)
    return book.begin(op, tensor, label) if book is not None else None


class GuardedWork:
    """An asynchronous collective's Work: marks the entry done, and a failure explains itself."""

    __slots__ = ("_work", "_entry", "_group", "__weakref__")

    def __init__(self, work: Any, entry: Entry, group: Any) -> None:
        self._work, self._entry, self._group = work, entry, group
        entry.work = weakref.ref(self)

    def wait(self, timeout: Any = None) -> Any:
        if timeout is not None:      # the caller's own deadline: its timeout is not a divergence
            result = self._work.wait(timeout)
            self._entry.done = True
            return result
        try:
            result = self._work.wait()
        except BaseException as exc:
            error = failed(self._entry, self._group, exc)
            if error is exc:
                raise
            raise error from exc
        self._entry.done = True
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        self._entry.done = self._entry.done or done
        return done

    def finished(self) -> bool:
        """Completion as the watcher may ask it: never runs a composite's finishing step."""
        parts = getattr(self._work, "parts_completed", None)
        return parts() if parts is not None else self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def end(entry: Entry | None, result: Any, group: Any) -> Any:
    """After the call returned: a synchronous collective is done; an asynchronous one is wrapped."""
    if entry is None:
        return result
    if result is not None and hasattr(result, "wait") and hasattr(result, "is_completed"):
        return GuardedWork(result, entry, group)
    entry.done = True
    return result


def failed(entry: Entry | None, group: Any, exc: BaseException) -> BaseException:
    """The error to raise for a failed collective: the diagnosis when there is one (this rank's,
    another rank's, or a peer that exited), else `exc` with a note naming the collective. Whatever
    the error, the entry is done: a collective that raised is not waited in."""
    if entry is None:
        return exc
    entry.done = True
    book = ledger(group)
    if book is None or not isinstance(exc, RuntimeError) or isinstance(exc, CollectiveDivergenceError):
        return exc
    message = book.failure
    if message is None:
        try:
            message = _diagnosis(book, entry)
        except Exception:
            message = None
    if message is _LEFT_TO_OWNER:
        return exc                   # the labelling layer (ZeRO-3's watchdog) reports it, in its own words
    if message is None:
        exc.add_note(f"deepspeed.comm: rank {book.ranks[book.rank]} was in collective #{entry.seq} of group "
                     f"'{book.name}', {entry.what()}; no other rank posted a diagnosis ({GUARD_ENV}).")
        return exc
    book.failure = message
    return CollectiveDivergenceError(f"rank {book.ranks[book.rank]}: {message}")


def _owner(label: Any) -> str | None:
    return getattr(type(label), "__module__", None) if hasattr(label, "describe") else None


_LEFT_TO_OWNER = "left to the layer that labelled the collective"
_DIAGNOSIS_WAIT_S = 2.0


def _diagnosis(book: Ledger, entry: Entry) -> str | None:
    """Another rank's posted diagnosis, or a report naming the peers that exited; waits up to
    `_DIAGNOSIS_WAIT_S` for one, since the failure may have come first (gloo closes a timed-out
    operation's connections before its rank has written why). A collective whose labelling layer
    reports failures itself (ZeRO-3's units) does not wait: that layer is about to post."""
    store = _tdist.distributed_c10d._get_default_store()
    owner = _owner(entry.label)
    deadline = time.monotonic() + (0.0 if owner is not None else _DIAGNOSIS_WAIT_S)
    while True:
        if store.check([book.key("abort")]):
            post = json.loads(store.get(book.key("abort")))
            if owner is not None and post.get("owner") == owner:
                return _LEFT_TO_OWNER
            if post.get("owner") is None:
                return post["message"]       # the guard's report: every rank's collective is in it
            return (f"this rank waits in collective #{entry.seq} of group '{book.name}', {entry.what()}, "
                    f"while {post['message']}\n{HINT}")
        peers = _read(store, [book.key("state", r) for r in range(book.world) if r != book.rank])
        if any(p is not None and p["state"] == "exited" for p in peers):
            mine = book.state(entry, time.monotonic())
            return report(book, sorted([mine, *[p for p in peers if p is not None]], key=lambda s: s["rank"]))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def announce(group: Any, message: str, owner: str | None = None) -> None:
    """Post a diagnosis made elsewhere (ZeRO-3's watchdog) so that every rank's failure carries it.
    A collective labelled by `owner`'s module (its labels' module) is left to that layer to report."""
    book = ledger(group)
    if book is None:
        return
    book.failure = book.failure or message
    try:
        store = _tdist.distributed_c10d._get_default_store()
        if not store.check([book.key("abort")]):
            store.set(book.key("abort"), json.dumps({"rank": book.ranks[book.rank], "message": message,
                                                     "owner": owner}))
    except Exception:
        pass


class _Exit:
    """What `linger` needs after the groups are gone (one owner: this module)."""

    store: Any = None
    peers: list[str] = []


_LINGER_S = 2.0


def exiting(error: bool) -> None:
    """At exit (comm/exit.py): stop the watcher and post each group's last collective, so that a
    rank still waiting for this one can say that it exited, and after what."""
    _Watcher.stop()
    if not _LEDGERS:
        return
    try:
        store = _tdist.distributed_c10d._get_default_store()
        world = _World.book
        if world is not None and world.rank == 0 and world.pid == os.getpid():   # the store's host, usually
            _Exit.store = store
            _Exit.peers = [world.key("state", r) for r in range(1, world.world)]
        for book in [b for b in _LEDGERS.values() if b.pid == os.getpid()]:   # not in a forked child
            last = book.journal[-1] if book.journal else None
            store.set(book.key("state", book.rank), json.dumps({
                "rank": book.ranks[book.rank], "state": "exited", "error": error, "seq": book.seq,
                "what": last.what() if last is not None else "", "sig": None,
                "journal": [[e.seq, e.op, e.signature()[2], _label(e), e.what()]
                            for e in list(book.journal)[-_POSTED:]]}))
    except Exception:   # the store's host may have exited first
        pass


def linger() -> None:
    """At exit, after the groups are destroyed, on rank 0 (which hosts the rendezvous store):
    keep the store up until every other rank has posted its own exit, for at most `_LINGER_S`.
    A rank still waiting in a collective fails when the group goes, and reads this rank's exit
    post from the store to say so; in a correct program the ranks exit together and this returns
    at once."""
    store, keys, _Exit.store = _Exit.store, _Exit.peers, None
    if store is None:
        return
    deadline = time.monotonic() + _LINGER_S
    try:
        while time.monotonic() < deadline:
            posts = _read(store, keys)
            if all(p is not None and p["state"] == "exited" for p in posts):
                return
            time.sleep(0.02)
    except Exception:
        pass
