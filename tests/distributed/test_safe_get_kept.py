"""What the `safe_get_*` helpers hand out stays valid: a tensor read between the boundary backward
and `engine.step()` keeps its value through the step, the next forward/backward and `zero_grad`
(at stage 0 `param.grad` is a view of the gradient bucket that the step zeroes in place; under
ZeRO the reduced shards are freed and re-created). The kept gradients equal a plain-PyTorch mean
gradient on the same global batch, the kept masters and optimizer states the values before the step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed
from models import global_batches, make_model, micro_slice
from test_engine_dp import _config

STEPS, GAS, MICRO = 3, 2, 2


def keep_across_steps(config: dict) -> dict:
    """Trains STEPS steps; at each boundary reads every safe_get_* and keeps the results, with a
    snapshot (clone) taken at the same moment. Returns both, plus the weights seen before each step."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state)

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=copy.deepcopy(config))
    zero = engine.zero_optimization_stage() > 0
    named = list(engine.module.named_parameters())
    kept, snapshots, weights = [], [], []
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * GAS * world)):
        weights.append({n: safe_get_full_fp32_param(p).clone() for n, p in named})
        for k in range(GAS):
            engine.backward(engine(micro_slice(x, MICRO, k, rank, world), micro_slice(y, MICRO, k, rank, world)))
            if k < GAS - 1:
                engine.step()  # not a boundary: nothing happens
        reads = {"grad": {n: safe_get_full_grad(p) for n, p in named},
                 "fp32": {n: safe_get_full_fp32_param(p) for n, p in named}}
        if step > 0:  # the optimizer holds state after the first step
            reads["momentum"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer") for n, p in named}
        if zero:
            reads["local_grad"] = {n: safe_get_local_grad(p) for n, p in named}
            reads["local_fp32"] = {n: safe_get_local_fp32_param(p) for n, p in named}
            if step > 0:
                reads["local_momentum"] = {n: safe_get_local_optimizer_state(p, "momentum_buffer") for n, p in named}
        snapshots.append({kind: {n: t.clone() for n, t in d.items()} for kind, d in reads.items()})
        kept.append(reads)
        engine.step()
    # one more forward/backward and a zero_grad after the last step: buffers are reused again
    engine.backward(engine(x[:MICRO], y[:MICRO]))
    engine.zero_grad()
    return {"kept": kept, "snapshots": snapshots, "weights": weights}


def sgd_reference(config: dict, world: int) -> list[dict]:
    """Plain torch: the mean gradient of each global batch at the weights the engine had."""
    params = config["optimizer"]["params"]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"])
    grads = []
    for x, y in global_batches(STEPS, MICRO * GAS * world):
        opt.zero_grad()
        model(x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


CASES = [(0, {}), (1, {}), (2, {}), (2, {"offload_optimizer": {"device": "cpu"}}), (3, {}),
         (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})]


@pytest.mark.parametrize("stage,zero", CASES, ids=[f"stage{s}{'-offload' if z else ''}" for s, z in CASES])
def test_safe_get_results_survive_step(stage: int, zero: dict) -> None:
    world = 2
    config = _config(micro=MICRO, gas=GAS, opt="SGD", zero_optimization={"stage": stage, **zero})
    config["optimizer"]["params"] = {"lr": 0.2, "momentum": 0.5}
    results = run_distributed(world, keep_across_steps, config)
    reference = sgd_reference(config, world)
    for rank, r in enumerate(results):
        for step, (kept, snap) in enumerate(zip(r["kept"], r["snapshots"])):
            for kind, values in kept.items():
                for name, value in values.items():
                    # bit equality: the snapshot is a clone of the very tensor, taken before the step
                    assert torch.equal(value, snap[kind][name]), (rank, step, kind, name, "changed by a later call")
            for name, grad in kept["grad"].items():
                torch.testing.assert_close(grad.float(), reference[step][name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} step {step} {name}")
                torch.testing.assert_close(kept["fp32"][name], r["weights"][step][name], rtol=0, atol=0)
    # the steps did train (the weights read before each step differ)
    first, last = results[0]["weights"][0], results[0]["weights"][-1]
    assert any(not torch.equal(first[n], last[n]) for n in first)
