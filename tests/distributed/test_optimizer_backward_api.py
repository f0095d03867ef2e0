"""Seed 003's ZeRO optimizer API on `engine.optimizer`, called as a client calls it.

[Note: the optimizer's backward API] in deepspeed/runtime/base_optimizer.py. Every stage's wrapper
(stage 0 fp16/bf16, ZeRO 1, 2, 3) answers the names; each test drives a real engine on gloo and
compares with `engine.backward` or with plain PyTorch (models_backward.py: SGD with momentum, which
changes when a gradient factor is applied twice or not at all).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from harness import run_distributed
from models_backward import batches, config, make_net, micro_slice, reference

STEPS = 3
STYLES = ("engine", "optimizer", "parts", "bracket")
CASES = [(0, "bf16"), (0, "fp16"), (1, "fp32"), (2, "fp32"), (2, "fp16"), (3, "fp32"), (3, "fp16")]


def _cfg(stage: int, precision: str, gas: int = 2, **extra) -> dict:
    cfg = config(gas=gas, precision=precision, **extra)
    cfg["zero_optimization"] = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return cfg


def _full_fp32(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def _full_grads(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}


def _backward(engine, loss: torch.Tensor, style: str) -> None:
    opt, gas = engine.optimizer, engine.gradient_accumulation_steps()
    if style == "engine":
        engine.backward(loss)
    elif style == "optimizer":   # upstream's engine: loss / gas, then optimizer.backward
        opt.backward(loss / gas)
    elif style == "parts":       # the seed's optimizer.backward, spelled out
        scaled = opt.backward_prologue(loss / gas)
        opt.enter_backward()
        scaled.backward()
        opt.backward_epilogue()
        opt.exit_backward()
    else:                        # a bracket only: exit_backward finishes the backward
        opt.enter_backward()
        opt.scale_if_loss(loss / gas).backward()
        opt.exit_backward()


def train_styles(cfg: dict, steps: int) -> dict:
    """Every rank: one fresh engine per style on the same batches; what the optimizer's post hook saw."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for style in STYLES:
        engine, *_ = deepspeed.initialize(model=make_net(), config=copy.deepcopy(cfg))
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        dtype = engine.module.fc1.weight.dtype
        calls, boundary_grads = [], []

        def hook(engine=engine, calls=calls, grads=boundary_grads) -> None:
            calls.append(engine.is_gradient_accumulation_boundary())
            if calls[-1] and not grads:   # the first boundary: the averaged gradients are there
                grads.append(_full_grads(engine))

        engine.optimizer.register_grad_acc_post_hook(hook)
        engine.optimizer.run_grad_acc_post_hooks()   # no backward active: nothing runs
        for x, y in batches(steps, micro * gas * world):
            for k in range(gas):
                loss = engine(micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world))
                _backward(engine, loss, style)
                engine.step()
        engine.optimizer.unregister_grad_acc_post_hooks()
        loss = engine(micro_slice(x, micro, 0, rank, world).to(dtype), micro_slice(y, micro, 0, rank, world))
        _backward(engine, loss, style)   # after unregister: no call
        out[style] = {"weights": _full_fp32(engine), "calls": calls, "grads": boundary_grads[0],
                      "skipped": engine.skipped_steps, "wrapper": type(engine.optimizer).__name__}
        engine.destroy()
    return out


def _first_step_grads(cfg: dict, world: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the gradient of the first global batch's mean loss."""
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    model = make_net()
    x, y = next(batches(1, micro * gas * world))
    model(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,precision", CASES)
def test_optimizer_backward_api_matches_engine_backward(stage: int, precision: str) -> None:
    cfg = _cfg(stage, precision)
    results = run_distributed(2, train_styles, cfg, STEPS)
    ref, ref_grads = reference(cfg, STEPS, 2)[0], _first_step_grads(cfg, 2)
    for rank, by_style in enumerate(results):
        base = by_style["engine"]
        assert base["wrapper"] == {0: "MixedPrecisionOptimizer", 3: "Stage3Optimizer"}.get(stage, "ZeroOptimizer")
        for style, result in by_style.items():
            where = f"rank {rank}, stage {stage} {precision}, {style}"
            # one call per backward (gas per step), after it; none after unregister
            assert result["calls"] == [False, True] * STEPS, where
            assert result["skipped"] == 0, where
            for name, value in result["weights"].items():
                torch.testing.assert_close(value, base["weights"][name], rtol=0, atol=0, msg=f"{where}: {name}")
            if precision == "fp32":   # fp16 gradients are read still multiplied by the loss scale
                for name, grad in result["grads"].items():
                    torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
                for name, value in result["weights"].items():
                    torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")


def test_optimizer_backward_api_single_rank_gas1() -> None:
    """gas 1: optimizer.backward(loss) is engine.backward(loss) itself."""
    cfg = _cfg(2, "fp16", gas=1)
    by_style = run_distributed(1, train_styles, cfg, STEPS)[0]
    for style, result in by_style.items():
        assert result["calls"] == [True] * STEPS, style
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, by_style["engine"]["weights"][name], rtol=0, atol=0)


def probe_dtypes_and_scaling(cfg: dict) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_net(), config=copy.deepcopy(cfg))
    opt = engine.optimizer
    loss = engine(torch.randn(2, 8).to(engine.module.fc1.weight.dtype), torch.tensor([0, 1]))
    fill_during = []
    engine.module.fc1.weight.register_post_accumulate_grad_hook(
        lambda p: fill_during.append(opt.report_ipg_memory_usage("fc1", p.numel())))
    scaled = opt.scale_if_loss(loss)
    out = {"needs_scaler": opt.needs_scaler(), "ratio": float(scaled / loss),
           "unchanged": opt.scale_if_loss(torch.ones(3)).tolist(),
           "comm": {n: opt.get_param_comm_dtype(p) for n, p in engine.module.named_parameters()}}
    engine.backward(loss)
    out["fill_during"], out["fill_after"] = fill_during, opt.report_ipg_memory_usage("after", 0)
    out["loss_scale"] = engine.optimizer.loss_scale
    engine.destroy()
    return out


@pytest.mark.parametrize("stage,precision,comm,expected", [
    (2, "bf16", None, torch.bfloat16), (2, "bf16", "fp32", torch.float32), (0, "fp16", None, torch.float16),
    (3, "fp32", None, torch.float32), (3, "bf16", "fp32", torch.float32), (1, "fp32", "bf16", torch.bfloat16)])
def test_comm_dtype_scaling_and_ipg_report(stage: int, precision: str, comm: str | None, expected) -> None:
    extra = {"communication_data_type": comm} if comm else {}
    got = run_distributed(1, probe_dtypes_and_scaling, _cfg(stage, precision, gas=1, **extra))[0]
    assert set(got["comm"].values()) == {expected}
    assert got["needs_scaler"] == (precision == "fp16")
    assert got["ratio"] == (got["loss_scale"] if precision == "fp16" else 1.0)
    assert got["unchanged"] == [1.0, 1.0, 1.0]   # not a loss: returned as is
    total = sum(p.numel() for p in make_net().parameters())
    assert got["fill_during"], "the report ran inside backward"
    for report in got["fill_during"] + [got["fill_after"]]:
        for dtype, (elements, percent) in report.items():
            assert isinstance(dtype, torch.dtype) and 0 <= elements <= total and percent >= 0
    assert all(elements == 0 for elements, _ in got["fill_after"].values())   # nothing waits after backward


def universal_round_trip(save_cfg: dict, load_cfg: dict, root: str) -> dict:
    """Train 2 steps and save; rank 0 converts with ds_to_universal; a fresh engine loads the hp state
    through the optimizer; its masters and Adam state equal the trained ones."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint.ds_to_universal import convert
    from deepspeed.utils import safe_get_full_optimizer_state

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_net(), config=copy.deepcopy(save_cfg))
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = engine.module.fc1.weight.dtype
    for x, y in batches(2, micro * gas * world):
        for k in range(gas):
            engine.backward(engine(micro_slice(x, micro, k, rank, world).to(dtype),
                                   micro_slice(y, micro, k, rank, world)))
            engine.step()
    engine.save_checkpoint(root, tag="step2")
    names = [n for n, _ in engine.module.named_parameters()]
    trained = {"fp32": _full_fp32(engine),
               "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg").clone()
                           for n, p in engine.module.named_parameters()}}
    engine.destroy()
    universal = os.path.join(root, "step2_universal")
    if rank == 0:
        convert(os.path.join(root, "step2"), universal)
    dist.barrier()
    fresh, *_ = deepspeed.initialize(model=make_net(seed=5), config=copy.deepcopy(load_cfg))
    fresh.optimizer.load_hp_checkpoint_state_from_checkpoint_dir("bit16_groups", universal)
    loaded = {"fp32": _full_fp32(fresh),
              "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg").clone()
                          for n, p in fresh.module.named_parameters()},
              "lr": fresh.optimizer.param_groups[0]["lr"]}
    try:
        fresh.optimizer.load_hp_checkpoint_state_from_checkpoint_dir("bit16_groups", os.path.join(root, "step2"))
        loaded["refused"] = None
    except Exception as error:   # not universal: named
        loaded["refused"] = str(error)
    fresh.destroy()
    return {"names": names, "trained": trained, "loaded": loaded}


@pytest.mark.parametrize("save_stage,load_stage", [(1, 1), (2, 2), (3, 3), (2, 3), (1, 0)])
def test_load_hp_state_from_universal_checkpoint(tmp_path, save_stage: int, load_stage: int) -> None:
    def cfg(stage: int) -> dict:
        c = _cfg(stage, "bf16" if stage == 0 else "fp32", gas=1)
        c["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        return c

    load_cfg = cfg(load_stage)
    load_cfg["optimizer"]["params"]["lr"] = 5e-2   # the checkpoint's param groups win
    results = run_distributed(2, universal_round_trip, cfg(save_stage), load_cfg, str(tmp_path))
    for rank, got in enumerate(results):
        for field in ("fp32", "exp_avg"):
            for name in got["names"]:
                torch.testing.assert_close(got["loaded"][field][name], got["trained"][field][name], rtol=0, atol=0,
                                           msg=f"rank {rank}: {field} of {name}")
        assert got["loaded"]["lr"] == 1e-2
        assert "not a universal checkpoint" in got["loaded"]["refused"] and "ds_to_universal" in \
            got["loaded"]["refused"]
