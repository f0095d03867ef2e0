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


def raise_if_any(error: BaseException | None, what: str, cleanup: Callable[[], Any] | None = None) -> None:
    """The agreement of `agreed` for an error caught by the caller (None: this rank succeeded)."""
    if agreement.vote(error is not None).failed:
        agreement.raise_agreed(what, describe(error) if error is not None else None, error, CheckpointError, cleanup)
