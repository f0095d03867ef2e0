"""Process exit: settle our outstanding collectives and tear down our process groups.

[Note: exiting without destroy_process_group]
A gloo process group runs its collectives on C++ worker threads. A worker that has finished
a collective drops its reference to the operation, and so to the tensors it read and wrote,
a moment *after* the waiting thread was woken. Dropping the last C++ reference to a tensor
that has a Python object needs the GIL. If the main thread has meanwhile reached interpreter
finalization (a script's last collective is typically a final `all_reduce` and `sys.exit`),
the worker asking for the GIL is made to exit (`PyThread_exit_thread`, i.e. `pthread_exit`);
the forced unwind through the work's noexcept destructor ends in `std::terminate`:
"terminate called without an active exception", SIGABRT, exit code 134, after all the work
was done (gdb: `runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject ->
gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> ... std::terminate`).

Only the process group's destructor joins those workers (gloo's `shutdown()` and `abort()`
leave them running), and `destroy_process_group()` runs it only when nothing else holds the
group: modules of torch imported after `init_process_group` (torch.distributed.nn.functional,
pulled in by torch._dynamo, which the optimizers import lazily) capture the default group in
their functions' default arguments (`group=group.WORLD`), so it is never freed and its workers
live until the process dies.

So `deepspeed.comm` registers one `atexit` step when it creates the default process group.
`atexit` steps run while the interpreter is whole (before finalization starts), after every
non-daemon thread has been joined. The step:

0. stops the collective guard's watcher and posts this rank's last collective per group in the
   store (comm/guard.py, [Note: collective guard]): a rank still waiting for this one names it;

1. settles the asynchronous collectives issued through `deepspeed.comm` that are still
   referenced (tracked weakly): polls them for a bounded time (`_SETTLE_S`; shorter when the
   process is exiting on an uncaught exception) and waits for the finished ones;
2. if one is still pending (a peer will never join it: this rank failed half way through a
   step), makes our groups' pending collectives fail at once (`comm/breaker.py`:
   peers see a closed connection, as they would when this process is gone) instead of waiting
   for them, here or in the group's destructor at finalization; if even then one is pending,
   it leaves the groups alone. A failing rank exits promptly; exit is never collective (no
   barrier);
3. destroys the process groups deepspeed.comm created and that are still alive: the
   default group when `init_distributed` made it (all groups go with it), else only subgroups
   made by `deepspeed.comm.new_group`. A group the script already destroyed is left alone, and
   so is a default group the script created itself with torch;
4. frees the groups it created that are destroyed (by it or by the script) but still held:
   points functions' default arguments that pin them at None and collects, so that their
   destructors join the worker threads now (the destructor releases the GIL while it joins,
   so a worker can finish its release);
5. on rank 0, which hosts the store: keeps the store up until the other ranks posted their exit
   (at most 2 s; at once when the ranks exit together), so that a rank whose collective failed
   when this one left can still read why.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
import types
import weakref
from typing import Any

import torch.distributed as _tdist

from ..utils.logging import logger

_SETTLE_S = 10.0          # bound on settling our outstanding collectives at a normal exit
_SETTLE_ON_ERROR_S = 1.0  # ... and at an exit on an uncaught exception


class _ExitState:
    """What the exit step needs; one owner (this module)."""

    registered = False
    owns_default = False
    subgroup_names: list[str] = []
    outstanding: "weakref.WeakSet[Any]" = weakref.WeakSet()
    created: list[Any] = []   # weak references to the groups we made
    modules_before: frozenset[str] = frozenset()   # modules imported before our first group


_STATE = _ExitState()


def track(work: Any) -> Any:
    """Remember an asynchronous Work (weakly) so that the exit step can settle it."""
    if work is not None and hasattr(work, "is_completed") and hasattr(work, "wait"):
        try:
            _STATE.outstanding.add(work)
        except TypeError:  # not weak-referenceable: nothing we can hold without keeping it alive
            pass
    return work


def process_group_created(owned: bool) -> None:
    """Called once the default process group exists; `owned` when deepspeed.comm made it."""
    _STATE.owns_default = _STATE.owns_default or owned
    if owned:
        _remember(_tdist.GroupMember.WORLD)
    _register()


def subgroup_created(group: Any) -> None:
    """Called for every group made by `deepspeed.comm.new_group`."""
    name = getattr(group, "group_name", None)
    if name is not None:
        _STATE.subgroup_names.append(name)
        _remember(group)
        _register()


def _remember(group: Any) -> None:
    try:
        _STATE.created.append(weakref.ref(group))
    except TypeError:
        pass


def _register() -> None:
    if not _STATE.registered:
        _STATE.registered = True
        _STATE.modules_before = frozenset(sys.modules)
        atexit.register(_at_exit)


def _exiting_on_error() -> bool:
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def settle(bound_s: float) -> bool:
    """Wait (polling, at most `bound_s`) for our tracked collectives; True when none is pending."""
    deadline = time.monotonic() + bound_s
    pending = list(_STATE.outstanding)
    while pending:
        still = []
        for work in pending:
            try:
                if work.is_completed():
                    work.wait()
                else:
                    still.append(work)
            except Exception:  # a failed collective is settled too (its error was or will be seen)
                pass
        pending = still
        if pending and time.monotonic() >= deadline:
            return False
        if pending:
            time.sleep(0.01)
    return True


def _live_subgroups() -> list[Any]:
    names = set(_STATE.subgroup_names)
    world = _tdist.distributed_c10d._world
    return [pg for pg, name in list(world.pg_names.items()) if name in names and pg is not _tdist.GroupMember.WORLD]


def _destroyed_but_alive() -> list[Any]:
    registered = _tdist.distributed_c10d._world.pg_names
    return [g for g in (ref() for ref in _STATE.created) if g is not None and g not in registered]


def _unpin(func: Any, ids: set[int]) -> None:
    """Point `func`'s default arguments that are one of the groups `ids` at None."""
    defaults, kwdefaults = func.__defaults__, func.__kwdefaults__
    if defaults and not ids.isdisjoint(map(id, defaults)):
        func.__defaults__ = tuple(None if id(v) in ids else v for v in defaults)
    if kwdefaults and not ids.isdisjoint(map(id, kwdefaults.values())):
        func.__kwdefaults__ = {k: None if id(v) in ids else v for k, v in kwdefaults.items()}


def _module_functions() -> Any:
    """Functions defined at module level or in module-level classes by the modules imported
    after our first group was created, and by __main__: where torch's pins live. (A function
    defined before the group existed cannot have it as a default.)"""
    for name, module in list(sys.modules.items()):
        if name in _STATE.modules_before and name != "__main__":
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            kind = type(value)
            if kind is types.FunctionType:
                if value.__module__ == name:
                    yield value
            elif issubclass(kind, type) and value.__dict__.get("__module__") == name:  # no __class__ lookups
                for member in list(value.__dict__.values()):
                    member = getattr(member, "__func__", member) if type(member) in (staticmethod, classmethod) else member
                    if type(member) is types.FunctionType:
                        yield member


def _every_function() -> Any:
    return (obj for obj in gc.get_objects() if type(obj) is types.FunctionType)


def free_destroyed_groups() -> bool:
    """Free the groups we made that were destroyed but are still held; True when none is left.

    Freeing a group runs its destructor, which joins its worker threads. What holds a destroyed
    group is usually the default arguments of functions defined after it was created
    ([Note: exiting without destroy_process_group]); those are pointed at None (the group is
    destroyed: such a default could only fail now). Cheapest search first: module-level
    functions and methods, then reference cycles, then every function."""
    for search in (_module_functions, gc.collect, _every_function, gc.collect):
        alive = _destroyed_but_alive()
        if not alive:
            return True
        ids = {id(group) for group in alive}
        del alive
        if search is gc.collect:
            gc.collect()
        else:
            for func in search():
                _unpin(func, ids)
    if _destroyed_but_alive():
        logger.debug("deepspeed.comm: a destroyed process group is still referenced at exit")
        time.sleep(0.05)  # its workers keep running: let them finish releasing (needs the GIL) now
        return False
    return True


def _break_pending_groups() -> None:
    """Make our groups' pending collectives fail now on every rank (gloo: comm/breaker.py), instead
    of their destructors waiting for them at finalization."""
    from .breaker import break_now, breakable

    def break_group(group: Any) -> None:
        if breakable(group):
            break_now(group)

    groups = [None] if _STATE.owns_default and _tdist.is_initialized() else []
    groups += _live_subgroups() if _tdist.is_initialized() else []
    for group in groups:
        try:
            break_group(group)
        except Exception:
            pass


def _at_exit() -> None:
    """The registered exit step ([Note: exiting without destroy_process_group])."""
    from .guard import exiting, linger

    exiting(error=_exiting_on_error())   # a rank still waiting for this one learns where it stopped
    try:
        bound = _SETTLE_ON_ERROR_S if _exiting_on_error() else _SETTLE_S
        if not settle(bound):
            # A peer will never join (this rank failed half way): fail the collective instead of
            # waiting for it here or in the group's destructor; peers see the closed connection.
            _break_pending_groups()
            if not settle(_SETTLE_ON_ERROR_S):
                logger.warning("deepspeed.comm: a collective was still pending at exit; leaving the process "
                               "group as it is rather than waiting for it")
                return
        if _tdist.is_available() and _tdist.is_initialized():
            if _STATE.owns_default:
                _tdist.destroy_process_group()
            else:
                for group in _live_subgroups():
                    _tdist.destroy_process_group(group)
        free_destroyed_groups()  # also when the script destroyed them itself: they may be pinned
        linger()   # rank 0 keeps the store up for a rank that may still be reading why this one left
    except Exception as exc:  # never turn a clean exit into a failure
        logger.warning(f"deepspeed.comm: process group teardown at exit failed: {exc!r}")
