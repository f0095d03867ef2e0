"""Loss scalers: DeepSpeed 0.19.8's dynamic schedule, unscale/overflow check, state, config, compat.

The expected scale sequences below were derived by hand from 0.19.8's DynamicLossScaler.update_scale
(see [Note: dynamic loss scale schedule] in deepspeed/runtime/precision/loss_scaler.py), not by
running this implementation. Pattern strings: "O" = overflow step, "." = clean step.
"""

import pickle

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.fp16.loss_scaler import (DELAYED_SHIFT, INITIAL_LOSS_SCALE, CreateLossScaler,
                                                DynamicLossScaler, LossScaler, LossScalerBase)
from deepspeed.runtime.precision import (DynamicScaler, LossScaleAtMinimumError, NoScaler, StaticScaler, make_scaler,
                                         scaler_from_state_dict)


def run(scaler, pattern):
    scales, hysteresis = [], []
    for step in pattern:
        scaler.update_scale(step == "O")
        scales.append(scaler.loss_scale)
        hysteresis.append(getattr(scaler, "cur_hysteresis", None))
    return scales, hysteresis


# --- the schedule ---------------------------------------------------------------------------------


def test_hysteresis_1_grows_after_window_plus_one_clean_steps():
    # start: last_overflow_iter=-1, so stable = cur_iter; grows at iters 3, 6; after the overflow at
    # iter 7 it grows again at iter 11 (stable = 11 - 7 - 1 = 3).
    scaler = DynamicScaler(init_scale=16, scale_window=3, delayed_shift=1)
    scales, _ = run(scaler, ".......O....OO.")
    assert scales == [16, 16, 16, 32, 32, 32, 64, 32, 32, 32, 32, 64, 32, 16, 16]
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (15, 13)


def test_hysteresis_2_refills_only_when_the_scale_grows():
    scaler = DynamicScaler(init_scale=16, scale_window=3, delayed_shift=2)
    scales, hyst = run(scaler, "OO.O....O.O")
    assert scales == [16, 8, 8, 4, 4, 4, 4, 8, 8, 8, 4]
    assert hyst == [1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = DynamicScaler(init_scale=16, scale_window=3, delayed_shift=2, consecutive_hysteresis=True)
    scales, hyst = run(scaler, "OO.O....O.O")
    assert scales == [16, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16]
    assert hyst == [1, 1, 2, 1, 2, 2, 2, 2, 1, 2, 1]


def test_window_1_doubles_every_clean_step_after_the_first():
    scales, _ = run(DynamicScaler(init_scale=1, scale_window=1), "...O..")
    assert scales == [1, 2, 4, 2, 2, 4]


def test_min_scale_clamps_a_non_power_of_two_floor():
    scaler = DynamicScaler(init_scale=8, min_scale=3, raise_error_at_min_scale=False)
    assert run(scaler, "OOO")[0] == [4, 3, 3]


def test_overflow_at_min_scale_raises_with_hints_and_leaves_state():
    scaler = DynamicScaler(init_scale=4, min_scale=1)
    assert run(scaler, "OO")[0] == [2, 1]
    with pytest.raises(LossScaleAtMinimumError) as info:
        scaler.update_scale(True)
    message = str(info.value)
    assert "fp16.min_loss_scale (1)" in message and "bf16" in message and "learning rate" in message
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, FloatingPointError)
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter) == (1, 2, 1)


def test_hysteresis_delays_the_error_at_min_scale():
    scaler = DynamicScaler(init_scale=2, min_scale=1, delayed_shift=2, consecutive_hysteresis=True)
    assert run(scaler, "OO.O")[0] == [2, 1, 1, 1]  # the clean step refilled hysteresis: no error yet
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update_scale(True)


def test_error_at_min_scale_can_be_turned_off():
    scaler = DynamicScaler(init_scale=2, min_scale=1, raise_error_at_min_scale=False)
    assert run(scaler, "OOOO")[0] == [1, 1, 1, 1]


@pytest.mark.parametrize("scaler", [StaticScaler(128.0), NoScaler()])
def test_fixed_scalers_never_change(scaler):
    before = scaler.loss_scale
    assert run(scaler, "O.O..OOO..")[0] == [before] * 10
    assert scaler.dynamic is False and scaler.cur_iter == 10


@pytest.mark.parametrize("kwargs, key", [({"scale_window": 0}, "fp16.loss_scale_window"),
                                         ({"min_scale": 0}, "fp16.min_loss_scale"),
                                         ({"delayed_shift": 0}, "fp16.hysteresis"),
                                         ({"scale_factor": 1}, "scale_factor"),
                                         ({"init_scale": 0}, "fp16.loss_scale")])
def test_bad_arguments_name_the_config_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DynamicScaler(**kwargs)


def test_scale_multiplies_the_loss():
    loss = torch.tensor(3.0, requires_grad=True)
    assert StaticScaler(8).scale(loss).item() == 24.0
    assert NoScaler().scale(loss) is loss
    assert DynamicScaler(init_scale=4).scale_loss(loss).item() == 12.0


# --- unscale_and_check ----------------------------------------------------------------------------


def test_unscale_finite_grads_in_place():
    grads = [torch.full((3, ), 8.0), torch.full((2, ), 4.0, dtype=torch.float16), None]
    assert StaticScaler(4).unscale_and_check(grads) is False
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [1.0] * 2
    assert grads[1].dtype == torch.float16


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_reports_non_finite(bad):
    grads = [torch.ones(4), torch.tensor([1.0, bad], dtype=torch.bfloat16)]
    assert DynamicScaler(init_scale=2).unscale_and_check(grads) is True
    assert NoScaler().unscale_and_check([torch.tensor([bad])]) is True  # bf16 overflow check


def test_one_collective_on_one_found_inf_tensor():
    calls = []

    def all_reduce(found_inf):  # another rank overflowed
        calls.append(found_inf)
        found_inf.add_(1.0)

    assert StaticScaler(2).unscale_and_check([torch.ones(2)], all_reduce=all_reduce) is True
    assert len(calls) == 1 and calls[0].shape == (1, ) and calls[0].dtype == torch.float32


def test_rank_without_grads_still_joins_the_collective():
    found_inf = torch.zeros(1)
    assert StaticScaler(2).unscale_and_check([], all_reduce=lambda t: t.fill_(1.0), found_inf=found_inf) is True
    assert NoScaler().unscale_and_check([None]) is False


def test_sparse_grads_take_the_per_tensor_path():
    grad = torch.sparse_coo_tensor([[0, 2]], [4.0, float("inf")], (3, ), check_invariants=True)
    assert StaticScaler(2).unscale_and_check([grad, torch.ones(1)]) is True
    assert grad.to_dense()[0].item() == 2.0


# --- state ----------------------------------------------------------------------------------------

DYNAMIC_KEYS = {"cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "dynamic_loss_scale"}


def test_state_dict_round_trip_resumes_the_same_schedule():
    make = lambda: DynamicScaler(init_scale=16, scale_window=3, delayed_shift=2)  # noqa: E731
    first = make()
    run(first, "O.O..")
    state = first.state_dict()
    assert set(state) == DYNAMIC_KEYS and state["dynamic_loss_scale"] is True
    second = make()
    second.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert run(second, "..O.O....") == run(first, "..O.O....")


def test_static_state_and_kind_mismatch():
    assert StaticScaler(64).state_dict() == {"cur_scale": 64.0, "cur_iter": 0, "dynamic_loss_scale": False}
    with pytest.raises(ValueError, match="dynamic loss scaler"):
        StaticScaler(64).load_state_dict(DynamicScaler().state_dict())
    restored = scaler_from_state_dict(DynamicScaler(init_scale=32).state_dict(), default=StaticScaler(64))
    assert isinstance(restored, DynamicScaler) and restored.loss_scale == 32
    kept = NoScaler()
    assert scaler_from_state_dict(DynamicScaler().state_dict(), default=kept) is kept and kept.loss_scale == 1


def test_fp16_optimizer_state_without_hysteresis_keys_loads():
    # 0.19.8 FP16_Optimizer.state_dict keys (dynamic case)
    state = {"dynamic_loss_scale": True, "cur_scale": 512.0, "cur_iter": 7, "last_overflow_iter": 5,
             "scale_factor": 2.0, "scale_window": 3}
    scaler = DynamicScaler(delayed_shift=2)
    scaler.load_state_dict(state)
    assert (scaler.loss_scale, scaler.cur_iter, scaler.scale_window, scaler.cur_hysteresis) == (512.0, 7, 3, 2)


def test_unpickled_upstream_scaler_object_works():
    # An upstream ZeRO checkpoint pickles DynamicLossScaler by path with these attributes.
    upstream = object.__new__(DynamicLossScaler)
    upstream.__dict__.update(cur_scale=8.0, dynamic=True, cur_iter=10, last_overflow_iter=9, scale_factor=2.0,
                             scale_window=1000, min_scale=1, delayed_shift=2, cur_hysteresis=1,
                             consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half)
    clone = pickle.loads(pickle.dumps(upstream))
    clone.update_scale(True)
    assert clone.loss_scale == 4.0 and clone.last_overflow_iter == 10
    fresh = scaler_from_state_dict(upstream, default=make_scaler(None))
    assert isinstance(fresh, NoScaler)
    resumed = scaler_from_state_dict(upstream, default=DynamicScaler())
    assert (resumed.cur_scale, resumed.cur_iter, resumed.cur_hysteresis) == (8.0, 10, 1)


# --- config and compat ----------------------------------------------------------------------------


def fp16_section(**fp16):
    return DeepSpeedConfig({"train_batch_size": 8, "fp16": {"enabled": True, **fp16}}).model.fp16


def test_make_scaler_dynamic_defaults():
    scaler = make_scaler(fp16_section())
    assert isinstance(scaler, DynamicScaler)
    assert (scaler.loss_scale, scaler.scale_window, scaler.min_scale, scaler.delayed_shift) == (2.0**16, 1000, 1, 2)
    assert scaler.consecutive_hysteresis is False and scaler.raise_error_at_min_scale is True


def test_make_scaler_dynamic_knobs():
    scaler = make_scaler(fp16_section(initial_scale_power=5, loss_scale_window=3, hysteresis=2,
                                      consecutive_hysteresis=True, min_loss_scale=4))
    assert (scaler.loss_scale, scaler.scale_window, scaler.min_scale, scaler.delayed_shift) == (32, 3, 4, 2)
    assert scaler.consecutive_hysteresis is True


def test_make_scaler_fp16_optimizer_rules_ignore_hysteresis():
    scaler = make_scaler(fp16_section(initial_scale_power=2, hysteresis=2), ignore_hysteresis=True)
    assert run(scaler, "OOOO")[0] == [2, 1, 1, 1]  # no hysteresis, no error at min


def test_make_scaler_static_and_off():
    assert isinstance(make_scaler(fp16_section(loss_scale=128)), StaticScaler)
    assert make_scaler(fp16_section(loss_scale=128)).loss_scale == 128
    bf16 = DeepSpeedConfig({"train_batch_size": 8, "bf16": {"enabled": True}}).model
    assert isinstance(make_scaler(bf16.fp16), NoScaler) and isinstance(make_scaler(None), NoScaler)


def test_compat_create_loss_scaler():
    args = {INITIAL_LOSS_SCALE: 16, "scale_window": 3, DELAYED_SHIFT: 1, "consecutive_hysteresis": False,
            "min_scale": 1}
    dynamic = CreateLossScaler(torch.half, 0, True, args)
    assert isinstance(dynamic, DynamicLossScaler) and isinstance(dynamic, LossScalerBase) and dynamic.dynamic
    assert run(dynamic, "...O")[0] == [16, 16, 16, 8]  # window 3 needs stable 3, i.e. iteration 3: overflowed
    static = CreateLossScaler(torch.half, 128, False, None)
    assert isinstance(static, LossScaler) and static.cur_scale == 128 and not static.has_overflow([])
    assert CreateLossScaler(torch.bfloat16, 128, True, args).cur_scale == 1.0


def test_compat_backward_scales_the_loss():
    weight = torch.ones(1, requires_grad=True)
    LossScaler(scale=4).backward((weight * 3).sum())
    assert weight.grad.item() == 12.0
