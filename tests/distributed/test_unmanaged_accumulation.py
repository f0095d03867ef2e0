"""managed_gradient_accumulation=false: the caller's step() ends the accumulation window.

Any number of backwards, then step(), which always applies an update. Checked against the managed
engine driven to the same windows by set_gradient_accumulation_boundary() (itself checked against
plain PyTorch in test_engine_dp/test_coalesce), at ZeRO 0-3 and with optimizer offload; stages 0-1
reduce once per step(), as many collectives as the managed engine's boundary."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import make_model

WINDOWS = [2, 3, 1]   # backwards per step(): differs per step and from gradient_accumulation_steps


def _config(stage: int, managed: bool, offload: bool = False) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
            "managed_gradient_accumulation": managed, "zero_optimization": zero}


def train(stage: int, managed: bool, offload: bool) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage, managed, offload))
    assert engine.managed_gradient_accumulation() is managed
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    applied, samples, collectives = [], [], 0
    for n in WINDOWS:
        dist.comms_counter.reset()
        for i in range(n):
            x, y = torch.randn(2, 16, generator=g), torch.randint(0, 4, (2,), generator=g)
            if managed:
                engine.set_gradient_accumulation_boundary(i == n - 1)
            engine.backward(engine(x, y) / n, scale_wrt_gas=False)
            if managed and i < n - 1:
                engine.step()   # not a boundary: counts the micro-step only
        engine.step()
        summary = dist.comms_counter.summary()
        collectives += sum(summary.get(op, {}).get("count", 0) for op in ("all_reduce", "reduce_scatter_tensor"))
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    else:
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"state": state, "applied": applied, "samples": samples, "steps": engine.global_steps,
            "collectives": collectives}


def both(stage: int, offload: bool) -> dict:
    return {"managed": train(stage, True, offload), "unmanaged": train(stage, False, offload)}


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (1, True), (3, True)])
def test_every_step_applies_and_matches_managed_windows(stage: int, offload: bool) -> None:
    for r in run_distributed(2, both, stage, offload):
        ref, test = r["managed"], r["unmanaged"]
        assert test["applied"] == [True, True, True] and test["steps"] == len(WINDOWS)
        # 2 ranks x micro-batch 2 x the backwards actually run (not train_batch_size per step)
        assert test["samples"] == [4 * 2, 4 * 5, 4 * 6]
        for name, value in ref["state"].items():
            torch.testing.assert_close(test["state"][name], value, rtol=1e-6, atol=1e-7, msg=name)
        if stage < 2:   # one reduction per window, in step(), like the managed boundary backward's
            assert test["collectives"] == ref["collectives"] > 0


def misuse() -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(1, managed=False))
    out = {}
    for name, call in [("boundary", lambda: engine.set_gradient_accumulation_boundary(True)),
                       ("coalesce", lambda: engine.coalesce_grad_reduction().__enter__()),
                       ("scale", lambda: engine.scale(engine(torch.randn(2, 16))))]:   # not a scalar loss
        try:
            call()
            out[name] = "no error"
        except AssertionError as e:
            out[name] = str(e)
    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                          loss_fn=torch.nn.MSELoss())
    config = {**_config(0, managed=False), "gradient_accumulation_steps": 1}
    try:
        deepspeed.initialize(model=pipe, config=config, model_parameters=pipe.parameters())
        out["pipeline"] = "no error"
    except AssertionError as e:
        out["pipeline"] = str(e)
    return out


def test_unmanaged_refuses_what_would_own_the_boundary_too() -> None:
    for r in run_distributed(2, misuse):
        assert "set_gradient_accumulation_boundary" in r["boundary"], r
        assert "coalesce_grad_reduction" in r["coalesce"], r
        assert "scalar tensor" in r["scale"], r   # (any mode: upstream's assertion, kept)
        assert "not supported with pipeline parallelism" in r["pipeline"], r
