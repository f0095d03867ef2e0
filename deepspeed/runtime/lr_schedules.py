"""DeepSpeed's learning-rate schedules: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR.

Every schedule is a pure function of ``last_batch_iteration`` (the index of the last
optimizer step taken); ``step()`` advances it and writes the new lr into the param groups.
Formulas, parameter names and defaults are those of DeepSpeed 0.19.8, including quirks
worth knowing:

* Construction with ``last_batch_iteration=-1`` already writes the lr the *first*
  optimizer step runs at: ``warmup_min_lr`` (WarmupLR/WarmupDecayLR), 0 (WarmupCosineLR,
  whatever ``warmup_min_ratio``), ``cycle_min_lr`` (OneCycle), ``lr_range_test_min_lr``.
  The engine calls ``step()`` after every optimizer step, so step 1 runs at the value for
  ``last_batch_iteration == 0``, which for the warmups is again the minimum.
* WarmupCosineLR scales the lrs the optimizer had at construction; the others set lrs.
* OneCycle with momentum cycling writes ``betas = (momentum, 0.99)``: beta2 is pinned.
* ``state_dict()`` holds only ``last_batch_iteration``; ``load_state_dict`` does not touch
  the optimizer (its lr comes back with the optimizer's own state, then ``step()``).
"""

from __future__ import annotations

import argparse
import inspect
import math

import torch
from torch.optim import Optimizer

from deepspeed.utils.logging import logger

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# (flag, type or "flag" for store_true, default, help) of the "Convergence Tuning" CLI group.
_TUNING_ARGS = [
    (LR_SCHEDULE, str, None, "LR schedule for training."),
    (LR_RANGE_TEST_MIN_LR, float, 0.001, "Starting lr value."),
    (LR_RANGE_TEST_STEP_RATE, float, 1.0, "scaling rate for LR range test."),
    (LR_RANGE_TEST_STEP_SIZE, int, 1000, "training steps per LR change."),
    (LR_RANGE_TEST_STAIRCASE, "flag", False, "use staircase scaling for LR range test."),
    (CYCLE_FIRST_STEP_SIZE, int, 1000, "size of first step of 1Cycle schedule (training steps)."),
    (CYCLE_FIRST_STAIR_COUNT, int, -1, "first stair count for 1Cycle schedule."),
    (CYCLE_SECOND_STEP_SIZE, int, -1, "size of second step of 1Cycle schedule (default first_step_size)."),
    (CYCLE_SECOND_STAIR_COUNT, int, -1, "second stair count for 1Cycle schedule."),
    (DECAY_STEP_SIZE, int, 1000, "size of intervals for applying post cycle decay (training steps)."),
    (CYCLE_MIN_LR, float, 0.01, "1Cycle LR lower bound."),
    (CYCLE_MAX_LR, float, 0.1, "1Cycle LR upper bound."),
    (DECAY_LR_RATE, float, 0.0, "post cycle LR decay rate."),
    ("cycle_momentum", "flag", False, "Enable 1Cycle momentum schedule."),
    (CYCLE_MIN_MOM, float, 0.8, "1Cycle momentum lower bound."),
    (CYCLE_MAX_MOM, float, 0.9, "1Cycle momentum upper bound."),
    (DECAY_MOM_RATE, float, 0.0, "post cycle momentum decay rate."),
    (WARMUP_MIN_LR, float, 0, "WarmupLR minimum/initial LR value"),
    (WARMUP_MAX_LR, float, 0.001, "WarmupLR maximum LR value."),
    (WARMUP_NUM_STEPS, int, 1000, "WarmupLR step count for LR warmup."),
    (WARMUP_TYPE, str, WARMUP_LOG_RATE, "WarmupLR increasing function during warmup"),
    (WARMUP_MIN_RATIO, float, 0.01, "Cosine LR lower bound."),
    (COS_MIN_RATIO, float, 0.01, "Cosine LR lower bound."),
]
# Which CLI values feed each schedule's params (upstream's override_*_params).
_CLI_KEYS = {
    LR_RANGE_TEST: [LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE],
    ONE_CYCLE: [CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
                DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM,
                DECAY_MOM_RATE],
    WARMUP_LR: [WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE],
    WARMUP_COSINE_LR: [WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO],
}  # fmt: skip
_CLI_KEYS[WARMUP_DECAY_LR] = _CLI_KEYS[WARMUP_LR]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add upstream's "Convergence Tuning" command-line group (``--lr_schedule`` etc.)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for name, kind, default, help_text in _TUNING_ARGS:
        if kind == "flag":
            group.add_argument(f"--{name}", default=default, action="store_true", help=help_text)
        else:
            group.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    return parser


def parse_arguments():
    """Parse only the tuning arguments from ``sys.argv``; returns ``(args, unknown_args)``."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _override(args, params: dict, keys) -> None:
    """Copy the tuning values named by ``keys`` that are set on ``args`` (not None) into ``params``."""
    for key in keys:
        if getattr(args, key, None) is not None:
            params[key] = getattr(args, key)


def override_lr_range_test_params(args, params: dict) -> None:
    _override(args, params, _CLI_KEYS[LR_RANGE_TEST])


def override_1cycle_params(args, params: dict) -> None:
    _override(args, params, _CLI_KEYS[ONE_CYCLE])


def override_warmupLR_params(args, params: dict) -> None:
    _override(args, params, _CLI_KEYS[WARMUP_LR])


def override_warmupCosineLR_params(args, params: dict) -> None:
    _override(args, params, _CLI_KEYS[WARMUP_COSINE_LR])


def override_params(args, params: dict) -> None:
    """Copy every tuning value set on ``args`` into ``params``, whatever schedule it belongs to."""
    for schedule in (LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_COSINE_LR):
        _override(args, params, _CLI_KEYS[schedule])


def get_config_from_args(args):
    """``({"type", "params"}, None)`` for ``--lr_schedule`` on the command line, else ``(None, why)``."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    config = {"type": schedule, "params": {}}
    _override(args, config["params"], _CLI_KEYS[schedule])
    return config, None


def get_lr_from_config(config: dict):
    """The peak lr a schedule config implies, as ``(lr, "")``, or ``(None, why)``."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(schedule, WARMUP_MAX_LR)
    return params[key], ""


def update_lr(param_groups, lrs) -> list:
    """Write ``lrs`` into ``param_groups`` (in place for tensor lrs); return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer):
    """The object whose ``param_groups`` a schedule drives.

    A ``torch.optim.Optimizer``, else the ``.optimizer`` it wraps (how upstream sees
    through its ZeRO/fp16 wrappers), else any object exposing ``param_groups``.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), Optimizer):
        return optimizer.optimizer
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _format_param(optimizer, value, name: str) -> list:
    """Broadcast a scalar to every param group, or check a per-group list/tuple."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _checked_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1): ``log(i + 1) / log(n)`` or ``i / n`` (upstream's float ops)."""
    if warmup_type == WARMUP_LOG_RATE:
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _BatchSchedule:
    """Common protocol: ``get_lr()`` depends only on ``last_batch_iteration``."""

    optimizer: Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list:
        raise NotImplementedError

    def step(self, last_batch_iteration=None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and apply its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list:
        """The lrs written by the last ``step()`` (or by construction)."""
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class LRRangeTest(_BatchSchedule):
    """LR range test: ``lr = min_lr * (1 + step_rate * interval)``, rising without bound.

    ``interval = (last_batch_iteration + 1) / step_size``, floored when ``staircase``.
    Used to find the largest lr that still trains (Smith, arXiv:1803.09820).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        self.optimizer = get_torch_optimizer(optimizer)
        self.min_lr = _format_param(self.optimizer, lr_range_test_min_lr, LR_RANGE_TEST_MIN_LR)
        _check_positive_int(lr_range_test_step_size, LR_RANGE_TEST_STEP_SIZE)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list:
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]

    def step(self, batch_iteration=None) -> None:
        """Advance to ``batch_iteration`` (default: the next one) and apply its lr."""
        super().step(batch_iteration)


class OneCycle(_BatchSchedule):
    """1Cycle: lr rises ``cycle_min_lr -> cycle_max_lr`` over ``cycle_first_step_size`` steps,
    falls back over ``cycle_second_step_size`` (default: the same), then optionally decays
    as ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)`` for post-cycle step ``k``.

    With ``cycle_momentum`` (and an optimizer with ``betas``) beta1 moves inversely
    between ``cycle_max_mom`` and ``cycle_min_mom``, then grows by ``1 + decay_mom_rate * k / decay_step_size``.
    A positive stair count holds the value flat on that many stairs per half cycle.
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
        last_batch_iteration=-1,
    ):
        self.optimizer = get_torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:  # also guards the division by step_ratio in _scale_factor
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay_interval = math.isclose(decay_step_size, 0)
        self.min_lrs = _format_param(self.optimizer, cycle_min_lr, CYCLE_MIN_LR)
        self.max_lrs = _format_param(self.optimizer, cycle_max_lr, CYCLE_MAX_LR)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_interval or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay_interval
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lrs)
        self.cycle_momentum = cycle_momentum and self._has_betas()
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)
            # Upstream pins beta2 at 0.99 while cycling beta1.
            self.min_moms = [(m, 0.99) for m in _format_param(self.optimizer, cycle_min_mom, CYCLE_MIN_MOM)]
            self.max_moms = [(m, 0.99) for m in _format_param(self.optimizer, cycle_max_mom, CYCLE_MAX_MOM)]
            if last_batch_iteration == -1:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _has_betas(self) -> bool:
        defaults = getattr(self.optimizer, "defaults", None)
        groups = self.optimizer.param_groups
        has_betas = "betas" in defaults if defaults is not None else all("betas" in g for g in groups)
        if not has_betas:
            logger.warning(
                f"cycle_momentum is disabled because optimizer {type(self.optimizer).__name__} does not support "
                "momentum, no betas attribute in defaults"
            )
        return has_betas

    def _scale_factor(self) -> float:
        """Position in the current cycle as a fraction of the amplitude, in [0, 1]."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset: the float scale can land 1e-16 under a stair.
            offset = iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self):
        """The ``betas`` tuples for the current iteration, or None without momentum cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b1 * (1 + self.decay_mom_rate * interval), b2) for b1, b2 in self.max_moms]

    def step(self, batch_iteration=None) -> None:
        """Advance to ``batch_iteration`` (default: the next one); apply its lr and betas."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_BatchSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``lr = min + (max - min) * gamma`` with ``gamma = log(i + 1) / log(n)`` (``log``) or
    ``i / n`` (``linear``), ``n = max(2, warmup_num_steps)``, and 1 after warmup.
    ``warmup_max_lr=None`` takes each group's lr at construction (upstream 0.19.8).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        _check_positive_int(warmup_num_steps, WARMUP_NUM_STEPS)
        self.optimizer = get_torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _format_param(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _format_param(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:  # not started: the lr of the first optimizer step
            return self.min_lrs
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    ``gamma = max(0, (total - i) / max(1, total - n))`` after warmup.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_BatchSchedule):
    """Scale each group's construction-time lr by a ratio: warm up from ``warmup_min_ratio``
    to 1 over ``warmup_num_steps`` (log or linear), then cosine-decay to ``cos_min_ratio``
    at ``total_num_steps`` and stay there. Before the first ``step()`` the lr is 0.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        _check_positive_int(warmup_num_steps, WARMUP_NUM_STEPS)
        self.optimizer = get_torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to the construction-time lrs at ``last_batch_iteration``."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            ratio = _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        decay_step = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, decay_step / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]


def _scheduler_classes() -> dict[str, type]:
    """``scheduler.type`` spellings: DeepSpeed's schedules, then ``torch.optim.lr_scheduler``'s."""
    base = torch.optim.lr_scheduler.LRScheduler
    torch_classes = {
        name: obj
        for name, obj in vars(torch.optim.lr_scheduler).items()
        if inspect.isclass(obj) and issubclass(obj, base) and not name.startswith("_") and obj is not base
    }
    ours = {LR_RANGE_TEST: LRRangeTest, ONE_CYCLE: OneCycle, WARMUP_LR: WarmupLR}
    ours.update({WARMUP_DECAY_LR: WarmupDecayLR, WARMUP_COSINE_LR: WarmupCosineLR})
    return {**torch_classes, **ours}


def build_scheduler(type_name: str, params: dict | None, optimizer):
    """Build the schedule for ``{"scheduler": {"type": type_name, "params": params}}``.

    ``type_name`` is one of :data:`VALID_LR_SCHEDULES` or a ``torch.optim.lr_scheduler``
    class name (exact spelling preferred, case-insensitive accepted). ``optimizer`` may be
    a wrapper exposing ``.optimizer`` or ``param_groups`` (see :func:`get_torch_optimizer`).
    Construction sets the lr of the first optimizer step (see the module docstring).

    Raises:
        ValueError: naming ``scheduler.type`` or ``scheduler.params.<key>`` and what is accepted.
    """
    classes = _scheduler_classes()
    cls = classes.get(type_name) or {k.lower(): v for k, v in classes.items()}.get(str(type_name).lower())
    if cls is None:
        raise ValueError(
            f"scheduler.type: got {type_name!r}; expected one of {', '.join(VALID_LR_SCHEDULES)} "
            f"or a torch.optim.lr_scheduler class ({', '.join(sorted(set(classes) - set(VALID_LR_SCHEDULES)))})"
        )
    params = dict(params or {})
    signature = inspect.signature(cls.__init__)
    names = list(signature.parameters)[2:]  # drop self, optimizer
    for key in params:
        if key not in names:
            raise ValueError(
                f"scheduler.params.{key}: not a parameter of scheduler type {cls.__name__}; "
                f"accepted keys: {', '.join(names)}"
            )
    for name in names:
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params:
            raise ValueError(f"scheduler.params.{name}: required by scheduler type {cls.__name__}; add it")
    if cls.__name__ not in VALID_LR_SCHEDULES:  # torch's schedulers insist on a real Optimizer
        optimizer = get_torch_optimizer(optimizer)
    return cls(optimizer, **params)
