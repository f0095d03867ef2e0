"""Shard arithmetic and the shard-by-shard backward shared by the tiled Functions (tiled_compute.py,
tiled_loss.py); see [Note: tiled backward] in tiled_compute.py."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch



def check_shards(shards: Any, where: str) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{where}: shards={shards!r} is not allowed: it must be an int >= 1")
    return shards


def shard_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """(start, size) of each shard of `length` rows: torch.chunk's split (ceil-sized, last shorter);
    one empty shard when `length` is 0, so `fn` still runs once and gives the output's shape."""
    step = max(1, math.ceil(length / shards))
    return [(start, min(step, length - start)) for start in range(0, length, step)] or [(0, 0)]


def grad_params(compute_params: Any) -> list[torch.nn.Parameter]:
    return [p for p in (compute_params or []) if p.requires_grad]


@contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """ZeRO-3 parameters whole for the whole shard loop (one gather, not one per shard); others as they are."""
    from ..zero.stage3.gathered import GatheredParameters
    from ..zero.stage3.sharded_param import unit_of
    sharded = [p for p in params if unit_of(p) is not None]
    if not sharded:
        yield
        return
    with GatheredParameters(sharded):
        yield


def begin_outer_backward(params: list[torch.nn.Parameter]) -> None:
    """See [Note: tiled backward]: a ZeRO-3 backward must start in the outer graph task, not in the first
    nested one (its epilogue would then run after the first shard)."""
    from ..zero.stage3.coordinator import begin_backward_of
    begin_backward_of(params)


def set_ready(params: list[torch.nn.Parameter], ready: bool) -> None:
    for p in params:   # upstream's protocol, read by ZeRO's gradient hooks (grad_reducer.py, stage3/coordinator.py)
        p.ds_grad_is_ready = ready


def shard_backward(params: list[torch.nn.Parameter], bounds: list[tuple[int, int]],
                    run_shard: Callable[[int, int, int], None]) -> None:
    """Call `run_shard(index, start, size)` (recompute + nested backward) per shard with ZeRO told to wait
    for the last shard; the flag is restored whatever happens."""
    begin_outer_backward(params)
    try:
        with gathered(params):
            for i, (start, size) in enumerate(bounds):
                set_ready(params, i + 1 == len(bounds))
                run_shard(i, start, size)
    finally:
        set_ready(params, True)


def leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad)


