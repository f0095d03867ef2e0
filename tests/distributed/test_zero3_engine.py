"""ZeRO stage 3 through deepspeed.initialize: parity with plain PyTorch and with stage 0,
clipping, param groups, backward driven by loss.backward(), and per-rank memory (shards only)."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed
from models import TinyMLP, make_model, micro_slice, global_batches, reference_training
from test_engine_dp import _config, train_engine

STEPS = 10


def _z3(threshold: int = 0, **extra) -> dict:
    return {"stage": 3, "stage3_param_persistence_threshold": threshold, **extra}


def _assert_close_to(results: list[dict], ref_losses: list[float], ref_state: dict, rtol: float = 1e-6,
                     atol: float = 1e-6) -> None:
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
        for name, ref in ref_state.items():
            torch.testing.assert_close(r["state"][name], ref, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gas", [1, 2])
def test_zero3_parity_with_plain_pytorch(world: int, gas: int) -> None:
    config = _config(micro=1, gas=gas, zero_optimization=_z3())
    results = run_distributed(world, train_engine, config, STEPS)
    ref_losses, ref_state, _ = reference_training(config, STEPS, world)
    _assert_close_to(results, ref_losses, ref_state)
    assert results[0]["global_steps"] == STEPS and results[0]["micro_steps"] == STEPS * gas


@pytest.mark.parametrize("zero", [_z3(), _z3(threshold=100_000), _z3(threshold=600, stage3_model_persistence_threshold=600),
                                  _z3(offload_optimizer={"device": "cpu"})],
                         ids=["sharded", "all-persistent", "some-persistent", "offload-optimizer"])
def test_zero3_equals_stage_0(zero: dict) -> None:
    """Same parameters as stage 0 trained the same way (persistence and CPU masters change nothing)."""
    config0 = _config(micro=1, gas=2, zero_optimization={"stage": 0})
    config3 = _config(micro=1, gas=2, zero_optimization=zero)
    ref = run_distributed(2, train_engine, config0, 6)[0]
    _assert_close_to(run_distributed(2, train_engine, config3, 6), ref["losses"], ref["state"], atol=1e-7)


@pytest.mark.parametrize("style", ["torch", "accelerate"])
def test_zero3_other_accumulation_drivers(style: str) -> None:
    config = _config(micro=2, gas=2, zero_optimization=_z3())
    results = run_distributed(2, train_engine, config, 4, style)
    ref_losses, ref_state, _ = reference_training(config, 4, 2)
    _assert_close_to(results, ref_losses, ref_state)


def test_zero3_gradient_clipping() -> None:
    config = _config(micro=2, gas=2, opt="SGD", gradient_clipping=0.05, zero_optimization=_z3())
    results = run_distributed(2, train_engine, config, 4)
    ref_losses, ref_state, _ = reference_training(config, 4, 2, clip=0.05)
    _assert_close_to(results, ref_losses, ref_state)
    assert results[0]["grad_norm"] > 0.05  # clipping was active
    assert results[0]["grad_norm"] == results[1]["grad_norm"]


def train_param_groups(stage: int, steps: int) -> dict:
    """Two param groups (different lr and weight decay) split inside the fc1 and head units."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world, micro = dist.get_rank(), dist.get_world_size(), 2
    model = make_model()
    named = dict(model.named_parameters())
    decay = [named[n] for n in ("fc1.weight", "fc2.weight", "head.weight")]
    rest = [p for n, p in named.items() if n not in ("fc1.weight", "fc2.weight", "head.weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "lr": 1e-2, "weight_decay": 0.1},
                                   {"params": rest, "lr": 3e-3, "weight_decay": 0.0}])
    config = _config(micro=micro, gas=1, zero_optimization=_z3() if stage == 3 else {"stage": stage})
    del config["optimizer"]
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for x, y in global_batches(steps, micro * world):
        loss = engine(micro_slice(x, micro, 0, rank, world), micro_slice(y, micro, 0, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    lrs = engine.get_lr()
    stage3 = getattr(engine, "_stage3", None)
    state = stage3.full_state() if stage3 is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "state": state, "lrs": lrs,
            "groups": [len(g) for g in getattr(opt, "model_param_groups", [])]}


def test_zero3_param_groups_equal_stage_0() -> None:
    ref = run_distributed(2, train_param_groups, 0, 5)
    results = run_distributed(2, train_param_groups, 3, 5)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref[rank]["losses"]), rtol=1e-6, atol=1e-6)
        for name, p in ref[rank]["state"].items():
            torch.testing.assert_close(r["state"][name], p, rtol=1e-6, atol=1e-7, msg=name)
        assert r["lrs"] == [1e-2, 3e-3]
        assert r["groups"] == [3, 3]   # model parameters per group (checkpoints read them)


def zero3_memory(steps: int) -> dict:
    """After a step, a rank holds its shards: parameters, fp32 masters and Adam state; its
    gradient shards are freed (created again by the next reduction)."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world, micro = dist.get_rank(), dist.get_world_size(), 2
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=_config(micro=micro, zero_optimization=_z3()))
    for x, y in global_batches(steps, micro * world):
        engine.backward(engine(micro_slice(x, micro, 0, rank, world), micro_slice(y, micro, 0, rank, world)))
        engine.step()
    coord = engine._stage3
    shard_numel = sum(-(-n // world) for u in coord.plan.units for n in u.numels)   # ceil(numel/N) per parameter
    storages: dict[int, int] = {}
    for p in engine.module.parameters():
        assert p.grad is None and p.numel() == 0, p.ds_shape   # released placeholders
        for t in (p.data, p.ds_tensor):
            if t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    state_numel = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return {"param_bytes": sum(storages.values()), "grad_bytes": sum(u._grad_shard.numel() * 4 for u in coord.units if u._grad_shard is not None),
            "fragment_grads": sum(m.grad is not None for g in opt.param_groups for m in g["params"]),
            "master_numel": opt.shard_numel(), "fragment_numel": sum(m.numel() for g in opt.param_groups for m in g["params"]),
            "state_numel": state_numel, "expected_shard_numel": shard_numel, "reducer": engine._reducer is None}


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_per_rank_memory_is_shards_only(world: int) -> None:
    numel = sum(p.numel() for p in TinyMLP().parameters())
    results = run_distributed(world, zero3_memory, 2)
    total_fragments = 0
    for r in results:
        shard = r["expected_shard_numel"]
        assert shard * world < numel + world * 3   # ceil(unit / N) per unit: padding only
        assert r["param_bytes"] == shard * 4 and r["master_numel"] == shard
        assert r["grad_bytes"] == 0 and r["fragment_grads"] == 0   # freed between steps
        assert r["state_numel"] == 2 * r["fragment_numel"]     # AdamW exp_avg + exp_avg_sq, fragments only
        assert r["reducer"]
        total_fragments += r["fragment_numel"]
    assert total_fragments == numel   # the fragments partition the model exactly


class CastingMLP(TinyMLP):
    """Casts its input to the parameters' dtype (a released ZeRO-3 placeholder keeps the dtype)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x.to(self.fc1.weight.dtype), y)


def train_bf16(stage: int, steps: int) -> dict:
    config = _config(micro=2, gas=2, bf16={"enabled": True},
                     zero_optimization=_z3() if stage == 3 else {"stage": stage})
    return train_engine(copy.deepcopy(config), steps, model_cls=CastingMLP)


def test_zero3_bf16_equals_stage_2() -> None:
    """bf16 parameters with fp32 masters: same numerics as stage 2 up to the reduction order."""
    ref = run_distributed(2, train_bf16, 2, 4)[0]
    results = run_distributed(2, train_bf16, 3, 4)
    assert results[0]["state"]["fc1.weight"].dtype == torch.bfloat16
    _assert_close_to(results, ref["losses"], ref["state"], rtol=8e-3, atol=1e-3)   # (identical on gloo today)


def destroy_restores_parameters() -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(zero_optimization=_z3()))
    assert any(p.numel() == 0 for p in engine.module.parameters())   # released placeholders
    engine.destroy()   # hooks removed, full parameters back
    for p, q in zip(engine.module.parameters(), make_model().parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_zero3_destroy_restores_full_parameters() -> None:
    run_distributed(2, destroy_restores_parameters)


class FrozenFirstMLP(TinyMLP):
    """fc1 frozen before initialize: its unit is gathered but never reduced nor stepped."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.requires_grad_(False)


def test_zero3_frozen_unit_equals_stage_1() -> None:
    config0 = _config(micro=1, gas=2, zero_optimization={"stage": 1})
    config3 = _config(micro=1, gas=2, zero_optimization=_z3())
    ref = run_distributed(2, train_engine, config0, 4, "engine", FrozenFirstMLP)[0]
    results = run_distributed(2, train_engine, config3, 4, "engine", FrozenFirstMLP)
    _assert_close_to(results, ref["losses"], ref["state"], atol=1e-7)
    initial = make_model(cls=FrozenFirstMLP).fc1.weight
    torch.testing.assert_close(results[0]["state"]["fc1.weight"], initial, rtol=0, atol=0)


def leaf_from_config(config: dict) -> dict:
    import deepspeed
    from deepspeed.utils import z3_leaf_module

    from models import make_model

    engine, *_ = deepspeed.initialize(model=make_model(), config=copy.deepcopy(config))
    return {n: z3_leaf_module(m) for n, m in engine.module.named_modules()}


def test_leaf_module_config_is_applied_at_stage_3() -> None:
    config = _config(micro=2, zero_optimization={"stage": 3, "leaf_module": {"names": ["fc2"]}})
    flags = run_distributed(2, leaf_from_config, config)[0]
    assert flags["fc2"] and not flags["fc1"] and not flags["head"]


def gathers_per_step(zero: dict, forward_only_first: bool = False) -> dict:
    """On every rank: all-gathers of one training step (micro 1, gas 1), the units it may gather,
    and the peak of gathered elements; optionally a forward without backward before it."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(micro=1, gas=1, zero_optimization=zero))
    x, y = next(iter(global_batches(1, world)))
    x, y = micro_slice(x, 1, 0, rank, world), micro_slice(y, 1, 0, rank, world)
    if forward_only_first:   # its kept units must be given back, not trip the step
        engine(x, y)
    coordinator = engine._stage3
    coordinator.stats.peak_live = coordinator.stats.live
    dist.comms_counter.reset()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    summary = dist.comms_counter.summary()
    count = summary.get("all_gather_into_tensor", {}).get("count", 0)
    wire = sum(summary.get(op, {}).get("wire_bytes", 0) for op in ("all_gather_into_tensor", "reduce_scatter_tensor"))
    sharded = [u for u in coordinator.units if not u.spec.persistent]
    return {"gathers": count, "units": len(sharded), "peak": coordinator.stats.peak_live,
            "largest": max(u.spec.numel for u in sharded), "total": sum(u.spec.numel for u in sharded),
            "loss": loss.item(), "left": len(coordinator.gathered_units()), "wire_elements": wire / 4,
            "psi": sum(p.numel() for p in make_model().parameters()), "world": world}


@pytest.mark.parametrize("forward_only_first", [False, True])
def test_units_kept_for_the_backward_within_the_budget(forward_only_first: bool) -> None:
    """[Note: keeping units for the backward]: DeepSpeed's default budget keeps every unit gathered
    from its forward to its backward (one all-gather per unit per step); a budget of 0 releases
    after the forward (two); a small budget keeps what fits. Losses are identical."""
    no_prefetch = {"stage3_prefetch_bucket_size": 0}   # only what the budget keeps is resident
    keep = run_distributed(2, gathers_per_step, _z3(**no_prefetch), forward_only_first)[0]
    none = run_distributed(2, gathers_per_step, _z3(stage3_max_reuse_distance=0, **no_prefetch),
                           forward_only_first)[0]
    small = run_distributed(2, gathers_per_step, _z3(stage3_max_live_parameters=none["largest"], **no_prefetch))[0]
    # after a forward without backward the kept units are still valid: the step gathers nothing
    assert keep["gathers"] == (0 if forward_only_first else keep["units"]), keep
    assert none["gathers"] == 2 * none["units"], none
    assert keep["units"] < small["gathers"] < none["gathers"], small
    assert keep["peak"] == keep["total"] and none["peak"] <= none["largest"] < keep["peak"], (keep, none)
    assert small["peak"] <= 2 * none["largest"], small
    assert keep["loss"] == none["loss"] == small["loss"]
    assert keep["left"] == none["left"] == small["left"] == 0   # nothing gathered after the step


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reuse", [None, 0])
def test_bytes_per_step_within_the_bound(world: int, reuse) -> None:
    """Per step each rank sends at most 1.05 x 3Psi(N-1)/N elements with units released after their
    forward (two all-gathers and one reduce-scatter per unit) and 1.05 x 2Psi(N-1)/N with units kept
    for the backward (the default), counted through deepspeed.comm (ring volume: (N-1)/N of each
    all-gather's output and reduce-scatter's input); the only other collective is the clipping norm."""
    extra = {} if reuse is None else {"stage3_max_reuse_distance": reuse}
    r = run_distributed(world, gathers_per_step, _z3(stage3_prefetch_bucket_size=0, **extra))[0]
    passes = 3 if reuse == 0 else 2
    bound = passes * r["psi"] * (world - 1) / world
    assert passes * r["total"] * (world - 1) / world <= r["wire_elements"] <= 1.05 * bound, (r, bound)


@pytest.mark.parametrize("extra", [{"communication_data_type": "bf16"}, {"prescale_gradients": True},
                                   {"gradient_predivide_factor": 2.0}])
def test_zero3_reduce_options_equal_stage_1(extra: dict) -> None:
    """communication_data_type (reduce-scatters in bf16: half the bytes) and DeepSpeed's
    prescale/predivide orders of averaging: stage 3 gives stage 1's numbers with the same options
    (one micro-step per step: both reduce each element once, in the same dtype, at world 2; with
    accumulation stage 1 reduces the accumulated sum, stage 3 every micro-step's)."""
    config1 = _config(micro=2, gas=1, zero_optimization={"stage": 1}, **extra)
    config3 = _config(micro=2, gas=1, zero_optimization=_z3(), **extra)
    ref = run_distributed(2, train_engine, config1, 4)[0]
    results = run_distributed(2, train_engine, config3, 4)
    _assert_close_to(results, ref["losses"], ref["state"], rtol=1e-6, atol=1e-7)
    plain = run_distributed(2, train_engine, _config(micro=2, gas=1, zero_optimization=_z3()), 4)[0]
    reduced = results[0]["comm"]["reduce_scatter_tensor"]
    assert reduced["numel"] == plain["comm"]["reduce_scatter_tensor"]["numel"]
    ratio = reduced["bytes"] / plain["comm"]["reduce_scatter_tensor"]["bytes"]
    assert ratio == (0.5 if "communication_data_type" in extra else 1.0), ratio
    if "communication_data_type" in extra:   # bf16 rounding shows: not the fp32 result
        assert results[0]["losses"] != plain["losses"]


def reduce_settings(extra: dict) -> tuple:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(zero_optimization=_z3(), **extra))
    reducer = engine._stage3.reducer
    return reducer.policy.before(), reducer.policy.after(), reducer.comm_dtype


def test_zero3_reduce_options_reach_the_reducer() -> None:
    """The averaging order is invisible in fp32 numbers (x/2 + y/2 vs (x + y)/2), so check where it goes."""
    assert run_distributed(2, reduce_settings, {})[0] == (1.0, 0.5, None)
    assert run_distributed(2, reduce_settings, {"prescale_gradients": True})[0] == (0.5, 1.0, None)
    assert run_distributed(2, reduce_settings, {"gradient_predivide_factor": 2.0,
                                                "communication_data_type": "fp16"})[0] == (0.5, 1.0, torch.float16)


def accum_dtype_warning() -> bool:
    import io
    import logging

    import deepspeed
    from deepspeed.utils.logging import logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        deepspeed.initialize(model=make_model(), config=_config(bf16={"enabled": True}, zero_optimization=_z3(),
                                                                data_types={"grad_accum_dtype": "bf16"}))
    finally:
        logger.removeHandler(handler)
    return "data_types.grad_accum_dtype=torch.bfloat16 is ignored at stage 3" in stream.getvalue()


def test_zero3_says_it_ignores_a_16_bit_grad_accum_dtype() -> None:
    assert run_distributed(2, accum_dtype_warning) == [True, True]
