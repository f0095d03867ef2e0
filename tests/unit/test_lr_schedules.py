"""LR schedules against closed-form formulas (DeepSpeed 0.19.8 semantics), over many steps.

``lr_at(i)`` below is the lr once ``last_batch_iteration == i``; the engine calls
``scheduler.step()`` after each optimizer step, so optimizer step k >= 1 runs at
``lr_at(k - 1)`` and step 0 at whatever construction wrote.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from deepspeed.runtime import lr_schedules as ls
from deepspeed.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_optimizer(lrs=(0.1,), cls=torch.optim.AdamW):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return cls(groups)


def lrs_of(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


def assert_follows(scheduler, optimizer, expected_lr, steps, first_lrs):
    """Construction wrote ``first_lrs``; then ``step()`` ``steps`` times matches ``expected_lr(i, group)``."""
    assert lrs_of(optimizer) == pytest.approx(first_lrs, rel=1e-12, abs=1e-15)
    for i in range(steps):
        scheduler.step()
        expected = [expected_lr(i, g) for g in range(len(optimizer.param_groups))]
        assert lrs_of(optimizer) == pytest.approx(expected, rel=1e-12, abs=1e-15), f"iteration {i}"
        assert scheduler.get_last_lr() == lrs_of(optimizer)


def warmup_gamma(i, n, kind):
    n = max(2, n)
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


# ----------------------------------------------------------------------------- WarmupLR family
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_closed_form(kind):
    optimizer = make_optimizer((0.5, 0.5))
    mins, maxs, n = [0.001, 0.0], [0.01, 0.02], 50
    scheduler = WarmupLR(optimizer, warmup_min_lr=mins, warmup_max_lr=maxs, warmup_num_steps=n, warmup_type=kind)

    def expected(i, g):
        gamma = warmup_gamma(i, n, kind) if i < n else 1.0
        return mins[g] + (maxs[g] - mins[g]) * gamma

    assert_follows(scheduler, optimizer, expected, 200, first_lrs=mins)


def test_warmup_lr_first_two_steps_run_at_min_and_max_defaults_to_optimizer_lr():
    optimizer = make_optimizer((0.3,))
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.01, warmup_num_steps=10)
    assert scheduler.max_lrs == [0.3]  # warmup_max_lr=None: the optimizer's lr (0.19.8)
    assert lrs_of(optimizer) == [0.01]  # optimizer step 0
    scheduler.step()
    assert lrs_of(optimizer) == [0.01]  # step 1: log(1) == 0
    scheduler.step()
    assert lrs_of(optimizer) == pytest.approx([0.01 + 0.29 * math.log(2) / math.log(10)])


def test_warmup_num_steps_one_is_raised_to_two_and_bad_values_rejected():
    assert WarmupLR(make_optimizer(), warmup_num_steps=1).warmup_num_steps == 2
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
            WarmupLR(make_optimizer(), warmup_num_steps=bad)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_closed_form(kind):
    optimizer = make_optimizer()
    n, total = 40, 300
    scheduler = WarmupDecayLR(optimizer, total, warmup_min_lr=1e-4, warmup_max_lr=2e-3, warmup_num_steps=n,
                              warmup_type=kind)  # fmt: skip

    def expected(i, g):
        gamma = warmup_gamma(i, n, kind) if i < n else max(0.0, (total - i) / max(1.0, total - n))
        return 1e-4 + (2e-3 - 1e-4) * gamma

    assert_follows(scheduler, optimizer, expected, total + 50, first_lrs=[1e-4])
    assert lrs_of(optimizer) == [1e-4]  # decayed to zero gamma, i.e. back to min


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("warmup_min_ratio,cos_min_ratio", [(0.0, 0.0001), (0.1, 0.05)])
def test_warmup_cosine_lr_closed_form(kind, warmup_min_ratio, cos_min_ratio):
    optimizer = make_optimizer((0.2, 0.05))
    n, total = 30, 250
    scheduler = WarmupCosineLR(optimizer, total, warmup_min_ratio=warmup_min_ratio, warmup_num_steps=n,
                               cos_min_ratio=cos_min_ratio, warmup_type=kind)  # fmt: skip
    base = [0.2, 0.05]

    def expected(i, g):
        if i < n:
            ratio = warmup_min_ratio + warmup_gamma(i, n, kind) * (1 - warmup_min_ratio)
        else:
            progress = min(1.0, (i - n + 1) / max(1, total - n))
            ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2
        return base[g] * ratio

    assert_follows(scheduler, optimizer, expected, total + 40, first_lrs=[0.0, 0.0])  # 0 before the first step
    assert lrs_of(optimizer) == pytest.approx([b * cos_min_ratio for b in base])  # stays at the floor


# ----------------------------------------------------------------------------- OneCycle
def one_cycle_scale(i, first, second, stairs1=0, stairs2=0):
    total = first + second
    offset = (i + 1) % total
    if offset <= first:
        position, stairs, length = offset, stairs1, first
    else:
        position, stairs, length = total - offset, stairs2, second
    return math.floor(position * stairs / length) / stairs if stairs > 0 else position / length


@pytest.mark.parametrize("first,second,stairs", [(20, 20, 0), (15, 35, 0), (20, 30, 4)])
def test_one_cycle_lr_and_momentum_closed_form(first, second, stairs):
    optimizer = make_optimizer((1.0, 1.0))
    lo, hi, lo_m, hi_m = [0.01, 0.02], [0.1, 0.3], 0.85, 0.95
    decay_step, lr_rate, mom_rate = 10, 0.5, 0.01
    scheduler = OneCycle(optimizer, lo, hi, decay_lr_rate=lr_rate, cycle_first_step_size=first,
                         cycle_second_step_size=second, cycle_first_stair_count=stairs, decay_step_size=decay_step,
                         cycle_min_mom=lo_m, cycle_max_mom=hi_m, decay_mom_rate=mom_rate)  # fmt: skip
    total = first + second
    assert lrs_of(optimizer) == lo
    assert [g["betas"] for g in optimizer.param_groups] == [(lo_m, 0.99)] * 2
    for i in range(total + 60):
        scheduler.step()
        if i < total:
            scale = one_cycle_scale(i, first, second, stairs, stairs)
            lrs = [a + (b - a) * scale for a, b in zip(lo, hi)]
            beta1 = hi_m - (hi_m - lo_m) * scale
        else:
            k = (i - total + 1) / decay_step
            lrs = [a / (1 + lr_rate * k) for a in lo]
            beta1 = hi_m * (1 + mom_rate * k)
        assert lrs_of(optimizer) == pytest.approx(lrs, rel=1e-12), f"iteration {i}"
        for group in optimizer.param_groups:
            assert group["betas"][0] == pytest.approx(beta1, rel=1e-12) and group["betas"][1] == 0.99


def test_one_cycle_without_decay_holds_min_and_sgd_disables_momentum():
    optimizer = make_optimizer(cls=torch.optim.SGD)
    scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=5)
    assert scheduler.cycle_momentum is False and "betas" not in optimizer.param_groups[0]
    for _ in range(30):
        scheduler.step()
    assert lrs_of(optimizer) == [0.01]
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive"):
        OneCycle(make_optimizer(), 0.01, 0.1, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="expected 1 value for cycle_max_lr"):
        OneCycle(make_optimizer(), 0.01, [0.1, 0.2])


# ----------------------------------------------------------------------------- LRRangeTest
@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_closed_form(staircase):
    optimizer = make_optimizer((1.0, 1.0))
    scheduler = LRRangeTest(optimizer, lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=7,
                            lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)  # fmt: skip

    def expected(i, g):
        interval = (i + 1) / 7
        interval = math.floor(interval) if staircase else interval
        return [1e-3, 2e-3][g] * (1 + 0.5 * interval)

    assert_follows(scheduler, optimizer, expected, 100, first_lrs=[1e-3, 2e-3])
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer"):
        LRRangeTest(make_optimizer(), lr_range_test_step_size=0)


# ----------------------------------------------------------------------------- shared protocol
SCHEDULES = [
    (WarmupLR, dict(warmup_num_steps=20, warmup_max_lr=0.1)),
    (WarmupDecayLR, dict(total_num_steps=60, warmup_num_steps=20)),
    (WarmupCosineLR, dict(total_num_steps=60, warmup_num_steps=20, warmup_min_ratio=0.1)),
    (OneCycle, dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10, decay_step_size=5,
                    decay_lr_rate=0.1)),
    (LRRangeTest, dict(lr_range_test_step_size=5, lr_range_test_staircase=True)),
]  # fmt: skip


@pytest.mark.parametrize("cls,kwargs", SCHEDULES)
def test_state_dict_round_trip_and_explicit_step(cls, kwargs):
    optimizer = make_optimizer()
    scheduler = cls(optimizer, **kwargs)
    for _ in range(25):
        scheduler.step()
    state = scheduler.state_dict()
    assert state == {"last_batch_iteration": 24}
    resumed_optimizer = make_optimizer()
    resumed = cls(resumed_optimizer, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(40):
        scheduler.step()
        resumed.step()
        assert lrs_of(resumed_optimizer) == lrs_of(optimizer)
    scheduler.step(7)  # jump, as the engine may after loading a checkpoint
    assert scheduler.last_batch_iteration == 7
    fresh_optimizer = make_optimizer()
    fresh = cls(fresh_optimizer, **kwargs)
    for _ in range(8):
        fresh.step()
    assert lrs_of(optimizer) == lrs_of(fresh_optimizer)


def test_resume_with_last_batch_iteration_leaves_optimizer_untouched():
    optimizer = make_optimizer((0.7,))
    scheduler = WarmupLR(optimizer, warmup_max_lr=0.1, warmup_num_steps=10, last_batch_iteration=4)
    assert lrs_of(optimizer) == [0.7]
    with pytest.raises(AssertionError, match="need to call step"):
        scheduler.get_last_lr()
    scheduler.step()
    assert lrs_of(optimizer) == pytest.approx([0.1 * math.log(6) / math.log(10)])


def test_tensor_lr_is_updated_in_place_and_wrappers_are_unwrapped():
    optimizer = make_optimizer()
    optimizer.param_groups[0]["lr"] = torch.tensor(0.1)
    lr_tensor = optimizer.param_groups[0]["lr"]

    class Wrapper:  # how ZeRO/fp16 wrappers look to upstream's schedules
        def __init__(self, inner):
            self.optimizer = inner

    scheduler = WarmupLR(Wrapper(optimizer), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    scheduler.step(9)
    assert optimizer.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.1)
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        WarmupLR(object())


# ----------------------------------------------------------------------------- build_scheduler
def test_build_scheduler_builds_ours_and_torch_schedules():
    optimizer = make_optimizer()
    scheduler = build_scheduler("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 10}, optimizer)
    assert isinstance(scheduler, WarmupDecayLR) and scheduler.total_num_steps == 100
    assert isinstance(build_scheduler("warmupcosinelr", {"total_num_steps": 10}, optimizer), WarmupCosineLR)
    step_lr = build_scheduler("StepLR", {"step_size": 3, "gamma": 0.5}, make_optimizer())
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize(
    "type_name,params,match",
    [
        ("WarmUp", {}, r"scheduler\.type: got 'WarmUp'; expected one of LRRangeTest, OneCycle, WarmupLR"),
        ("WarmupLR", {"warmup_steps": 5}, r"scheduler\.params\.warmup_steps: .*accepted keys: warmup_min_lr"),
        ("WarmupDecayLR", {}, r"scheduler\.params\.total_num_steps: required"),
        ("OneCycle", {"cycle_min_lr": 0.1}, r"scheduler\.params\.cycle_max_lr: required"),
    ],
)
def test_build_scheduler_errors_name_the_config_path(type_name, params, match):
    with pytest.raises(ValueError, match=match):
        build_scheduler(type_name, params, make_optimizer())


def test_constants_and_cli_helpers_match_upstream():
    assert ls.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (ls.WARMUP_LR, ls.WARMUP_DECAY_LR, ls.WARMUP_COSINE_LR) == ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    assert (ls.ONE_CYCLE, ls.LR_RANGE_TEST) == ("OneCycle", "LRRangeTest")
    args = ls.add_tuning_arguments(argparse.ArgumentParser()).parse_args(
        ["--lr_schedule", "WarmupLR", "--warmup_num_steps", "7"]
    )
    assert (args.warmup_max_lr, args.warmup_type, args.cycle_first_stair_count) == (0.001, "log", -1)
    config, error = ls.get_config_from_args(args)
    assert error is None and config == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 7, "warmup_type": "log"},
    }
    assert ls.get_lr_from_config(config) == (0.001, "")
    assert ls.get_config_from_args(argparse.Namespace())[0] is None
