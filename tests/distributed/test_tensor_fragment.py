"""deepspeed.utils.safe_* accessors: full and local views of fp32 masters, gradients, optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed
from models import global_batches, make_model, micro_slice
from test_engine_dp import _config

STEPS, SET_STEP = 3, 1
BF16 = {"bf16": {"enabled": True}}


def new_param(shape: torch.Size, salt: int) -> torch.Tensor:
    """The value written with safe_set_full_fp32_param (same in the workers and the reference)."""
    n = torch.Size(shape).numel()
    return torch.linspace(-0.3, 0.3, n).reshape(shape) + 0.01 * salt


def fragment_run(config: dict, steps: int, set_step: int) -> dict:
    """Trains with the engine; reads everything through the safe_* API on every rank."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state)

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=copy.deepcopy(config))
    dtype = next(engine.module.parameters()).dtype
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    named = list(engine.module.named_parameters())
    out: dict = {"grads": [], "masters": [], "exp_avg": [], "exp_avg_sq": [], "visible": None}
    for step, (x, y) in enumerate(global_batches(steps, micro * gas * world)):
        for k in range(gas):
            xb, yb = micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world)
            engine.backward(engine(xb, yb))
            if engine.is_gradient_accumulation_boundary():
                out["grads"].append({n: safe_get_full_grad(p).float().clone() for n, p in named})
            engine.step()
        if step == set_step:
            for salt, (n, p) in enumerate(named):
                safe_set_full_fp32_param(p, new_param(p.shape, salt))
                halved = 0.5 * safe_get_full_optimizer_state(p, "exp_avg")  # keeps Adam well-conditioned
                safe_set_full_optimizer_state(p, halved, "exp_avg")
            out["visible"] = {n: p.detach().clone() for n, p in named}
        out["masters"].append({n: safe_get_full_fp32_param(p) for n, p in named})
        for key in ("exp_avg", "exp_avg_sq"):
            out[key].append({n: safe_get_full_optimizer_state(p, key) for n, p in named})
    out["weights"] = {n: p.detach().clone() for n, p in named}
    return out


def adamw_reference(config: dict, world: int, grads: list[dict] | None = None, bf16_init: bool = False) -> dict:
    """Plain torch AdamW, on the global batch or (grads given) fed the engine's gradients, with
    the same values set after step SET_STEP."""
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    model = make_model()
    if bf16_init:  # the engine's fp32 masters start from the bf16-cast weights
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    hp = config["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    named = list(model.named_parameters())
    out: dict = {"grads": [], "params": [], "exp_avg": [], "exp_avg_sq": []}
    for step, (x, y) in enumerate(global_batches(STEPS, micro * gas * world)):
        opt.zero_grad()
        if grads is None:
            model(x, y).backward()
        else:
            for n, p in named:
                p.grad = grads[step][n].clone()
        out["grads"].append({n: p.grad.clone() for n, p in named})
        opt.step()
        if step == SET_STEP:
            with torch.no_grad():
                for salt, (n, p) in enumerate(named):
                    p.copy_(new_param(p.shape, salt))
                    opt.state[p]["exp_avg"].mul_(0.5)
        out["params"].append({n: p.detach().clone() for n, p in named})
        for key in ("exp_avg", "exp_avg_sq"):
            out[key].append({n: opt.state[p][key].clone() for n, p in named})
    return out


def _close(actual: dict, expected: dict, rtol: float, atol: float, what: str) -> None:
    for name, ref in expected.items():
        assert actual[name].dtype == torch.float32, (what, name, actual[name].dtype)
        torch.testing.assert_close(actual[name], ref, rtol=rtol, atol=atol, msg=f"{what} {name}")


CASES = [(1, 0, 1, "fp32"), (1, 1, 1, "fp32"), (1, 2, 1, "fp32"), (2, 0, 2, "fp32"), (2, 1, 2, "fp32"),
         (2, 2, 2, "fp32"), (2, 0, 1, "bf16"), (2, 1, 2, "bf16"), (2, 2, 1, "bf16"), (4, 2, 1, "fp32"),
         (2, 1, 1, "fp32-offload")]


@pytest.mark.parametrize("world,stage,gas,precision", CASES)
def test_full_accessors_match_plain_adamw(world: int, stage: int, gas: int, precision: str) -> None:
    zero = {"stage": stage, "reduce_bucket_size": 500}
    if precision == "fp32-offload":  # DeepSpeedCPUAdam on CPU master shards
        zero, precision = {**zero, "offload_optimizer": {"device": "cpu"}}, "fp32"
    config = _config(micro=1, gas=gas, zero_optimization=zero, **(BF16 if precision == "bf16" else {}))
    results = run_distributed(world, fragment_run, config, STEPS, SET_STEP)
    reference = adamw_reference(config, world)  # plain PyTorch on the global batch, fp32
    for r in results:
        assert len(r["grads"]) == STEPS
        for step in range(STEPS):
            if precision == "fp32":
                _close(r["grads"][step], reference["grads"][step], 1e-6, 1e-7, f"grad step {step}")
            else:  # bf16 forward/backward: the fp32-accumulated average tracks the fp32 gradient
                _close(r["grads"][step], reference["grads"][step], 0.1, 1e-2, f"bf16 grad step {step}")
            torch.testing.assert_close(r["grads"][step], results[0]["grads"][step], rtol=0, atol=0)
    # masters and optimizer state: a plain AdamW fed the gradients safe_get_full_grad returned
    shadow = adamw_reference(config, world, results[0]["grads"], bf16_init=precision == "bf16")
    for r in results:
        for step in range(STEPS):
            if precision == "fp32":
                _close(r["masters"][step], reference["params"][step], 1e-6, 1e-6, f"master step {step}")
            _close(r["masters"][step], shadow["params"][step], 1e-6, 1e-7, f"master step {step}")
            _close(r["exp_avg"][step], shadow["exp_avg"][step], 1e-6, 1e-10, f"exp_avg step {step}")
            _close(r["exp_avg_sq"][step], shadow["exp_avg_sq"][step], 1e-6, 1e-14, f"exp_avg_sq step {step}")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for salt, (name, value) in enumerate(r["visible"].items()):  # set is visible in the model at once
            assert torch.equal(value, new_param(value.shape, salt).to(dtype)), name
            assert torch.equal(r["masters"][SET_STEP][name], new_param(value.shape, salt)), name
        for name, weight in r["weights"].items():  # the weights are the masters rounded to their dtype
            assert weight.dtype == dtype
            assert torch.equal(r["masters"][-1][name].to(dtype), weight), name
    if precision == "bf16":  # the fp32 master, not the bf16 weight widened
        last, weights = results[0]["masters"][-1], results[0]["weights"]
        assert any(not torch.equal(last[n], weights[n].float()) for n in last)


def visible_weights(engine) -> dict:
    """The values the model computes with (stage 3: gathered from the shards; persistent units
    as they are)."""
    import contextlib

    stage3 = getattr(engine, "_stage3", None)
    with stage3.gathered() if stage3 is not None else contextlib.nullcontext():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def local_parts(stage: int, zero: dict | None = None) -> dict:
    """World 2: local views of a ZeRO engine (stage 1, 2 or 3), straddling parameters, and error cases."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                                 safe_update_full_grad_vectorized)

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(micro=2, zero_optimization={"stage": stage, "reduce_bucket_size": 500, **(zero or {})})
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=cfg)
    named = list(engine.module.named_parameters())
    shards = opt.units if stage == 3 else opt.buckets  # unit masters at stage 3: same attributes
    where = {id(p): (b, i) for b, sb in enumerate(shards) for i, p in enumerate(sb.params)}
    owners = {n: shards[where[id(p)][0]].partition.owners(where[id(p)][1]) for n, p in named}
    x, y = next(global_batches(1, 2 * world))
    engine.backward(engine(micro_slice(x, 2, 0, rank, world), micro_slice(y, 2, 0, rank, world)))
    out: dict = {"owners": owners, "local": {}, "full": {}}
    out["local"]["grad"] = {n: safe_get_local_grad(p).clone() for n, p in named}
    out["full"]["grad"] = {n: safe_get_full_grad(p) for n, p in named}
    safe_update_full_grad_vectorized([p for _, p in named], lambda g, p: 2 * g)
    out["doubled"] = all(torch.equal(safe_get_full_grad(p), 2 * out["full"]["grad"][n]) for n, p in named)
    for n, p in named:  # a local write of the gradient: halve it back
        safe_set_local_grad(p, 0.5 * safe_get_local_grad(p))
    out["halved"] = all(torch.equal(safe_get_full_grad(p), out["full"]["grad"][n]) for n, p in named)
    engine.step()
    for kind, get_local, get_full in (("fp32", safe_get_local_fp32_param, safe_get_full_fp32_param),
                                      ("exp_avg", lambda p: safe_get_local_optimizer_state(p, "exp_avg"),
                                       lambda p: safe_get_full_optimizer_state(p, "exp_avg"))):
        out["local"][kind] = {n: get_local(p).clone() for n, p in named}
        out["full"][kind] = {n: get_full(p) for n, p in named}
    errors = []
    for key in ("step", "no_such_state"):  # raised on every rank: none is left in the all-reduce
        try:
            safe_get_full_optimizer_state(named[0][1], key)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    # local writes: this rank's part only; the model follows at the next step's all-gather
    before = visible_weights(engine)
    for n, p in named:
        part = safe_get_local_fp32_param(p)
        safe_set_local_fp32_param(p, torch.full_like(part, float(rank + 1)))
        safe_set_local_optimizer_state(p, torch.full_like(part, 0.5), "exp_avg")
    out["after_local_set"] = {n: safe_get_full_fp32_param(p) for n, p in named}
    out["exp_avg_after_set"] = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named}
    after = visible_weights(engine)
    out["model_unchanged"] = all(torch.equal(after[n], before[n]) and after[n].numel() for n in before)
    return out


def assert_local_parts(r0: dict, r1: dict) -> None:
    """Both ranks' local parts concatenate to the full tensors; local writes touch only them."""
    straddling = [n for n, ranks in r0["owners"].items() if ranks == [0, 1]]
    assert straddling, r0["owners"]
    assert r0["doubled"] and r1["doubled"] and r0["halved"] and r1["halved"]
    for kind in ("grad", "fp32", "exp_avg"):
        for name, full in r0["full"][kind].items():
            torch.testing.assert_close(r1["full"][kind][name], full, rtol=0, atol=0)
            parts = [r0["local"][kind][name], r1["local"][kind][name]]
            assert [p.numel() > 0 for p in parts] == [rank in r0["owners"][name] for rank in (0, 1)], name
            assert torch.equal(torch.cat(parts), full.flatten()), (kind, name)
    for name in straddling:  # each rank wrote rank+1 over its part: the full tensor shows both
        values = r0["after_local_set"][name].flatten()
        n0 = r0["local"]["fp32"][name].numel()
        assert torch.equal(values[:n0], torch.ones(n0)) and torch.equal(values[n0:], torch.full_like(values[n0:], 2))
        assert torch.equal(r0["exp_avg_after_set"][name], torch.full_like(values, 0.5).reshape_as(
            r0["exp_avg_after_set"][name]))
    assert r0["model_unchanged"] and r1["model_unchanged"]
    assert r0["errors"] == r1["errors"] == ["step not found in optimizer state fragment",
                                              "no_such_state not found in optimizer state fragment"]


@pytest.mark.parametrize("stage", [1, 2])
def test_local_parts_concatenate_to_full_and_straddle(stage: int) -> None:
    # bucket 500 splits fc2.weight (its own bucket) and head.weight between the ranks
    assert_local_parts(*run_distributed(2, local_parts, stage))


def stage0_and_unowned() -> dict:
    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_fp32_param,
                                 safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param)

    model = make_model()
    model.fc1.bias.requires_grad_(False)  # frozen: no optimizer owns it
    engine, *_ = deepspeed.initialize(model=model, config=_config(micro=2))
    stray = torch.nn.Parameter(torch.ones(3))
    out = {"stray": (safe_get_full_fp32_param(stray), safe_get_full_grad(stray)),
           "frozen": (safe_get_full_fp32_param(model.fc1.bias), safe_get_full_grad(model.fc1.bias))}
    safe_set_full_fp32_param(stray, torch.zeros(3))  # no owner: a no-op, as upstream
    out["stray_value"] = stray.detach().clone()
    bias = model.fc1.bias
    out["frozen_local"] = (safe_get_local_fp32_param(bias), safe_get_local_grad(bias),
                           safe_get_local_optimizer_state(bias, "exp_avg"))
    try:
        safe_get_local_fp32_param(model.fc1.weight)
        out["local"] = "no error"
    except AssertionError as err:
        out["local"] = str(err)
    return out


def test_stage0_local_api_and_unowned_params() -> None:
    out = run_distributed(2, stage0_and_unowned)[0]
    assert out["stray"] == (None, None) and out["frozen"] == (None, None)
    assert out["frozen_local"] == (None, None, None)   # frozen: None, as the full getters
    assert torch.equal(out["stray_value"], torch.ones(3))
    assert "only defined for ZeRO-partitioned parameters" in out["local"]


def stage3_frozen_local() -> tuple:
    import deepspeed
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state

    cfg = {**_config(micro=2), "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = make_model()
    model.fc1.bias.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    x = torch.randn(2, 16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    frozen = model.fc1.bias
    trained = safe_get_local_fp32_param(model.fc1.weight)
    return (safe_get_local_fp32_param(frozen), safe_get_local_grad(frozen),
            safe_get_local_optimizer_state(frozen, "exp_avg"), trained is not None and trained.dim() == 1)


def test_stage3_local_getters_give_none_for_a_frozen_parameter() -> None:
    """Upstream's own tensor-fragment test expects None here (its frozen-weights cases)."""
    assert run_distributed(2, stage3_frozen_local) == [(None, None, None, True)] * 2
