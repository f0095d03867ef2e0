"""A dropped engine frees its model ([Note: tensor hooks and dropped engines] in
deepspeed/utils/weak_hooks.py): gradient hooks on parameters used to hold the reducer (stages
0-2) or the ZeRO-3 coordinator's units, through a reference Python's garbage collector cannot
see, so every engine built and dropped kept its parameters, buffers and shards alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from harness import run_distributed


def _dropped_engine_frees(stage: int, reuse_model: bool) -> dict:
    import deepspeed

    def build(model: nn.Module):
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(torch.randn(2, 16)).square().mean())
        engine.step()
        return engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    engine = build(model)
    param, engine_ref = weakref.ref(next(model.parameters())), weakref.ref(engine)
    if reuse_model and stage < 3:  # a second engine on the same model: no dead hooks left behind
        del engine
        gc.collect()
        engine = build(model)
        hooks = max(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
        del engine
        gc.collect()
        return {"hooks_per_param": hooks, "engine_freed": engine_ref() is None}
    del engine, model
    gc.collect()
    return {"param_freed": param() is None, "engine_freed": engine_ref() is None}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropping_engine_and_model_frees_the_parameters(stage: int) -> None:
    assert run_distributed(2, _dropped_engine_frees, stage, False) == [{"param_freed": True, "engine_freed": True}] * 2


@pytest.mark.parametrize("stage", [0, 2])
def test_a_model_reused_by_a_new_engine_carries_one_hook_per_parameter(stage: int) -> None:
    assert run_distributed(2, _dropped_engine_frees, stage, True) == [{"hooks_per_param": 1, "engine_freed": True}] * 2
