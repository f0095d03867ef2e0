"""Tensor hooks that do not keep their owner alive.

[Note: tensor hooks and dropped engines]
A gradient hook registered on a parameter with a bound method (`p.register_post_accumulate_grad_hook(
reducer._on_grad_ready)`) makes a cycle parameter -> hook -> reducer -> its buckets -> parameter,
and tensor hooks are invisible to Python's cycle collector, so dropping the engine (and even the
model) left every parameter, its flat buffer and the reducer alive: a script that builds engines
in a loop (sweeps, tests) grew by a model per engine. The hook holds its owner weakly instead;
when the owner is collected, its hooks are removed from the parameters (a model reused by a new
engine carries no dead hooks).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable, *bound: Any) -> Callable:
    """`method(*bound, *args)` while `method`'s object lives, else nothing. `bound` is held
    strongly: pass plain values (indices), not objects of the owner's (a unit bound here stays
    alive until the hook is removed, one garbage collection later)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        target = ref()
        return None if target is None else target(*bound, *args)

    return hook


def remove_when_collected(owner: Any, handles: list[Any]) -> None:
    """Remove `handles` (hook handles of `owner`, a list it may still extend) once `owner` is
    garbage; an explicit removal before that is harmless."""
    weakref.finalize(owner, _remove, handles)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
