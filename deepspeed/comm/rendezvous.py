"""Bounded-time agreement that every rank reached the same collective call.

[Note: arrival check]
A collective that only some ranks call (`if rank == 0: engine.save_checkpoint(...)`) waits
until the backend timeout (30 minutes) and then fails with a message that names nothing.
Before such calls the runtime announces the call in the c10d store that torch.distributed
already uses for rendezvous: every rank increments one counter and waits, polling, until all
ranks have arrived. A rank that waits longer than `timeout_s` raises an error naming the call
and the ranks that never arrived; a straggler that arrives after the others gave up times out
the same way, so no rank hangs. The store is not a collective: nothing is counted.
"""

from __future__ import annotations

import itertools
import os
import time

import torch.distributed as _tdist

DEFAULT_TIMEOUT_S = float(os.environ.get("DEEPSPEED_ARRIVAL_TIMEOUT_S", "300"))
_calls = itertools.count()
_GAVE_UP = -(1 << 40)  # an arrival counter's value once a rank stopped waiting


class RanksDidNotArrive(RuntimeError):
    """Some ranks did not reach a call that every rank must make."""


def arrive_and_wait(what: str, timeout_s: float | None = None, hint: str = "") -> None:
    """Return once every rank called `arrive_and_wait` for its n-th time; see [Note: arrival check]."""
    if not _tdist.is_available() or not _tdist.is_initialized() or _tdist.get_world_size() == 1:
        return
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    store = _tdist.distributed_c10d._get_default_store()
    rank, world = _tdist.get_rank(), _tdist.get_world_size()
    key = f"deepspeed/arrive/{next(_calls)}"
    store.set(f"{key}/{rank}", what)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    arrived = store.add(key, 1)
    while 0 <= arrived < world:
        if time.monotonic() > deadline:
            # Give up atomically: only while fewer than `world` ranks arrived does the counter
            # become negative, so a rank arriving later raises too instead of entering the
            # collective alone, and no rank can have gone on before.
            current = store.compare_set(key, str(arrived), str(_GAVE_UP))
            if int(current) == _GAVE_UP:
                missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
                raise RanksDidNotArrive(f"{what}: ranks {missing} of {world} did not call it within "
                                        f"{timeout_s:g} s (this is rank {rank}); every rank must make this call. "
                                        f"{hint}".strip())
            arrived = int(current)  # someone arrived meanwhile: look again
            continue
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)
    if arrived < 0:
        raise RanksDidNotArrive(f"{what}: this rank ({rank}) arrived after the other ranks stopped waiting for it "
                                f"(timeout {timeout_s:g} s); every rank must make this call. {hint}".strip())
    others = {store.get(f"{key}/{r}").decode() for r in range(world)}
    if len(others) > 1:
        raise RanksDidNotArrive(f"ranks made different calls at the same point: {sorted(others)}")
