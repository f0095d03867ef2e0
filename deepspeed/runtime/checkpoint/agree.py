"""Checkpoint failures that only some ranks see, turned into one CheckpointError every rank raises.

The mechanism is runtime/agreement.py's ([Note: agreed errors]): every local phase of a
checkpoint call runs under `agreed`, and `.failures` of the raised CheckpointError names each
failing rank and its error. When every rank failed with the same CheckpointError (a missing tag
on a shared file system), that error is raised as it is.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ...checkpoint.files import CheckpointError
from .. import agreement

T = TypeVar("T")


def describe(error: BaseException) -> str:
    return agreement.describe(error, CheckpointError)


def agreed(what: str, fn: Callable[[], T], cleanup: Callable[[], Any] | None = None,
           none_ok: bool = False) -> T:
    """Run the local phase `fn` on this rank, then agree: raise on every rank if any rank failed.

    With `none_ok`, `fn` may return None ("nothing to do", e.g. no `latest` file): every rank
    must then return None, and a rank that got None while others did not is an error too."""
    return agreement.agreed(what, fn, CheckpointError, cleanup, none_ok)


def agreed_gather(what: str, fn: Callable[[], tuple[T, Any]], cleanup: Callable[[], Any] | None = None
                  ) -> tuple[T, list[Any]]:
    """`agreed` for a local phase that also shares something: `fn` returns (its result, a small
    picklable value for every rank). One all_gather_object carries each rank's error text or
    value, so the agreement and the exchange cost one collective (save_checkpoint's first phase
    shares its tag and optimizer fields this way). Returns (the result, every rank's value)."""
    result: Any = None
    error: BaseException | None = None
    try:
        result, shared = fn()
        mine: tuple = (None, shared)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error, mine = e, (describe(e), None)
    everyone = agreement.gather(mine)
    if any(text is not None for text, _ in everyone.values()):
        agreement.raise_agreed(what, mine[0], error, CheckpointError, cleanup,
                               texts={r: text for r, (text, _) in everyone.items()})
    return result, [value for _, value in everyone.values()]


def raise_if_any(error: BaseException | None, what: str, cleanup: Callable[[], Any] | None = None) -> None:
    """The agreement of `agreed` for an error caught by the caller (None: this rank succeeded)."""
    if agreement.vote(error is not None).failed:
        agreement.raise_agreed(what, describe(error) if error is not None else None, error, CheckpointError, cleanup)
