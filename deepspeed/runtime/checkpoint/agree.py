"""Failures that only some ranks see, turned into one error every rank raises.

[Note: agreed checkpoint errors]
A checkpoint call alternates local work (reading or writing files, building state) with
collectives (re-cutting partitions, re-gathering parameters, publishing). A failure that only
one rank sees (its shard file is missing or corrupt, its disk is full, its tag is malformed)
must not let that rank raise while the others walk into the next collective and wait there
for the backend's timeout. So every local phase runs under `agreed`: the phase's exception is
caught, one small all-reduce (two floats) tells every rank whether any rank failed, and only
then (on failure only) the failing ranks' messages are exchanged, so every rank raises a
`CheckpointError` naming each failing rank and its error (`.failures`: {rank: message}); the
failing rank's own exception is chained as the cause. When every rank failed with the same
CheckpointError (a missing tag on a shared file system), that error is raised as it is. The
all-reduce runs on the calling (main) thread, like every collective.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from ... import comm as ds_comm
from ...checkpoint.files import CheckpointError

T = TypeVar("T")
_NONE = object()


def describe(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def agreed(what: str, fn: Callable[[], T], cleanup: Callable[[], Any] | None = None,
           none_ok: bool = False) -> T:
    """Run the local phase `fn` on this rank, then agree: raise on every rank if any rank failed.

    With `none_ok`, `fn` may return None ("nothing to do", e.g. no `latest` file): every rank
    must then return None, and a rank that got None while others did not is an error too."""
    result: Any = _NONE
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    none = result is None and error is None
    failed, nones = _all_sum([1.0 if error is not None else 0.0, 1.0 if none else 0.0])
    world = ds_comm.get_world_size() if _distributed() else 1
    if failed == 0 and none_ok and 0 < nones < world:
        error_text = "found nothing to do (no `latest` file?) while other ranks went on" if none else None
        _raise(what, error_text, None, cleanup, prefix="ranks disagree")
    if failed > 0:
        _raise(what, describe(error) if error is not None else None, error, cleanup)
    return result


def agreed_gather(what: str, fn: Callable[[], tuple[T, Any]], cleanup: Callable[[], Any] | None = None
                  ) -> tuple[T, list[Any]]:
    """`agreed` for a local phase that also shares something: `fn` returns (its result, a small
    picklable value for every rank). One all_gather_object carries each rank's error text or
    value, so the agreement and the exchange cost one collective (save_checkpoint's first phase
    shares its tag and optimizer fields this way). Returns (the result, every rank's value)."""
    result: Any = _NONE
    error: BaseException | None = None
    try:
        result, shared = fn()
        mine: tuple = (None, shared)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error, mine = e, (describe(e), None)
    everyone = [mine]
    if _distributed():
        everyone = [None] * ds_comm.get_world_size()
        ds_comm.all_gather_object(everyone, mine)
    if any(text is not None for text, _ in everyone):
        _raise(what, mine[0], error, cleanup, texts=[text for text, _ in everyone])
    return result, [value for _, value in everyone]


def raise_if_any(error: BaseException | None, what: str, cleanup: Callable[[], Any] | None = None) -> None:
    """The agreement of `agreed` for an error caught by the caller (None: this rank succeeded)."""
    failed, _ = _all_sum([1.0 if error is not None else 0.0, 0.0])
    if failed > 0:
        _raise(what, describe(error) if error is not None else None, error, cleanup)


def _distributed() -> bool:
    return ds_comm.is_initialized() and ds_comm.get_world_size() > 1


def _all_sum(values: list[float]) -> tuple[float, float]:
    flags = torch.tensor(values, dtype=torch.float64)
    if _distributed():
        ds_comm.all_reduce(flags)
    return float(flags[0]), float(flags[1])


def _raise(what: str, mine: str | None, error: BaseException | None, cleanup: Callable[[], Any] | None,
           prefix: str = "failed", texts: list[Any] | None = None) -> None:
    rank = ds_comm.get_rank() if _distributed() else 0
    if texts is None:  # not yet exchanged (agreed_gather has): only on failure, every rank learns what went wrong where
        texts = [mine]
        if _distributed():
            texts = [None] * ds_comm.get_world_size()
            ds_comm.all_gather_object(texts, mine)
    if cleanup is not None:  # on every rank: no partial file stays behind on node-local storage either
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
    failures = {r: t for r, t in enumerate(texts) if t is not None}
    if len(failures) == len(texts) and len(set(failures.values())) == 1:
        if error is not None:  # every rank saw the same: raise it as it is (its type: ValueError for a bad argument)
            try:
                error.failures = failures
            except AttributeError:   # an exception type without instance attributes
                pass
            raise error
        detail = failures[0] + (" (on every rank)" if len(texts) > 1 else "")
    else:
        detail = "; ".join(f"rank {r}: {t}" for r, t in failures.items())
        if mine is None:
            detail += f" (this is rank {rank}, which succeeded but stops too)"
    agreed_error = CheckpointError(f"{what} {prefix}: {detail}")
    agreed_error.failures = failures  # {rank: its error}
    raise agreed_error from error
