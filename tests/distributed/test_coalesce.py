"""engine.coalesce_grad_reduction() (upstream 0.19.8 API) and engine.empty_partition_cache().

coalesce: backwards inside the block only accumulate locally; leaving it reduces once. The
result must equal reducing after every backward (ZeRO 0-3, fp32 and bf16), with fewer
gradient collectives at the stages that otherwise reduce per backward (2, 3).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import make_model

CHUNKS = 4


def _config(stage: int, bf16: bool = False, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, **zero}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(config: dict, coalesce: bool, steps: int = 2) -> dict:
    import contextlib

    import deepspeed
    import deepspeed.comm as dist

    rank = dist.get_rank()
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_model()
    else:
        model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    dtype = torch.bfloat16 if config.get("bf16") else torch.float32
    g = torch.Generator().manual_seed(10 + rank)
    collectives = 0
    for _ in range(steps):
        dist.comms_counter.reset()
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for i in range(CHUNKS):
                x, y = torch.randn(2, 16, generator=g).to(dtype), torch.randint(0, 4, (2,), generator=g)
                engine.set_gradient_accumulation_boundary(i == CHUNKS - 1)
                engine.backward(engine(x, y))
        summary = dist.comms_counter.summary()
        collectives += sum(summary.get(op, {}).get("count", 0) for op in ("all_reduce", "reduce_scatter_tensor"))
        engine.step()
    state = {}
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            state = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    else:
        state = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"state": state, "collectives": collectives, "steps": engine.global_steps}


def both(config: dict) -> dict:
    return {"ref": train(config, False), "test": train(config, True)}


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_coalesced_reduction_matches_per_backward_reduction(stage: int, bf16: bool) -> None:
    results = run_distributed(2, both, _config(stage, bf16, stage3_param_persistence_threshold=0))
    for rank in results:
        ref, test = rank["ref"], rank["test"]
        assert test["steps"] == ref["steps"] == 2
        for name, value in ref["state"].items():
            torch.testing.assert_close(test["state"][name], value, atol=2e-2 if bf16 else 1e-5, rtol=0)
        if stage in (2, 3):   # these reduce after every backward; coalesced once per step
            assert test["collectives"] < ref["collectives"], (test["collectives"], ref["collectives"])
    for name, value in results[0]["test"]["state"].items():   # replicas agree
        torch.testing.assert_close(results[1]["test"]["state"][name], value, atol=0, rtol=0)


def misuse(stage: int) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage))
    x, y = torch.randn(2, 16), torch.tensor([0, 1])
    with engine.coalesce_grad_reduction():
        engine.backward(engine(x, y))
        with pytest.raises(AssertionError, match="no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync"):
            with engine.no_sync():
                pass
    with engine.no_sync():
        with pytest.raises(AssertionError, match="nested"):
            with engine.coalesce_grad_reduction():
                pass
    engine.pipeline_parallelism = True
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    return {"ok": True}


def test_coalesce_rejects_step_and_nesting() -> None:
    assert all(r["ok"] for r in run_distributed(2, misuse, 1))


def empty_cache() -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    config = _config(3, stage3_param_persistence_threshold=0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x, y = torch.randn(2, 16), torch.tensor([0, 1])
    loss = engine(x, y)   # units stay gathered for the backward that follows
    held_before = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    engine.empty_partition_cache()
    held_after = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    engine.backward(loss)   # the backward still works: its units are gathered again
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    return {"before": held_before, "after": held_after, "finite": finite}


def test_empty_partition_cache_releases_units_kept_for_backward() -> None:
    for r in run_distributed(2, empty_cache):
        assert r["before"] > 0 and r["after"] == 0 and r["finite"]
