"""Pure batch-size arithmetic: train_batch_size = micro_batch_per_gpu * grad_accum_steps * dp_world.

Which member is derived when some are missing follows DeepSpeed 0.19.8
(`DeepSpeedConfig._set_batch_related_parameters`):
    train + micro      -> gas   = train / (micro * world)
    train + gas        -> micro = train / (gas * world)
    micro + gas        -> train = micro * gas * world
    train only         -> gas = 1, micro = train / world
    micro only         -> gas = 1, train = micro * world
    gas only, nothing  -> error
Upstream floors the divisions and then fails a generic assertion; here a division that does not
come out even is reported with its arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import DeepSpeedConfigError

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
WORLD = "data-parallel world size"


@dataclass(frozen=True)
class BatchSizes:
    """A consistent batch triple."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _check_given(name: str, value: Optional[int]) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an integer, got {value!r}"
    if value < 1:
        return f"{name} must be >= 1, got {value}"
    return None


def _divide(total: int, total_name: str, parts: list[tuple[str, int]]) -> int:
    """total / product(parts), or an error that shows the arithmetic."""
    divisor = 1
    for _, value in parts:
        divisor *= value
    if total % divisor:
        shown = " * ".join(f"{name} ({value})" for name, value in parts)
        product = f" = {divisor}" if len(parts) > 1 else ""
        raise DeepSpeedConfigError(f"{total_name} ({total}) is not divisible by {shown}{product}")
    return total // divisor


def resolve_batch(train: Optional[int], micro: Optional[int], gas: Optional[int], dp_world_size: int) -> BatchSizes:
    """Fill the missing members of train = micro * gas * dp_world_size, or raise naming the values."""
    problems = [p for p in (_check_given(n, v) for n, v in ((TRAIN, train), (MICRO, micro), (GAS, gas))) if p]
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        problems.append(f"{WORLD} must be an integer >= 1, got {dp_world_size!r}")
    if problems:
        raise DeepSpeedConfigError(problems)
    world = (WORLD, dp_world_size)
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * dp_world_size:
            raise DeepSpeedConfigError(
                f"{TRAIN} ({train}) != {MICRO} ({micro}) * {GAS} ({gas}) * {WORLD} ({dp_world_size}) = "
                f"{micro * gas * dp_world_size}")
    elif train is not None and micro is not None:
        gas = _divide(train, TRAIN, [(MICRO, micro), world])
    elif train is not None and gas is not None:
        micro = _divide(train, TRAIN, [(GAS, gas), world])
    elif micro is not None and gas is not None:
        train = micro * gas * dp_world_size
    elif train is not None:
        gas, micro = 1, _divide(train, TRAIN, [world])
    elif micro is not None:
        gas, train = 1, micro * dp_world_size
    else:
        given = f" (only {GAS} = {gas} was given)" if gas is not None else ""
        raise DeepSpeedConfigError(f"either {TRAIN} or {MICRO} must be given{given}")
    return BatchSizes(train, micro, gas)
