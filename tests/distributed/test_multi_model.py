"""Training several DeepSpeedEngines at once ("Training Multiple Models" in the training docs).

(1) Independent engines trained side by side on the same batches, each with engine.backward:
    each must equal its own plain-PyTorch reference.
(2) Joint training with one shared loss, sum(l / (i + 1)), and one `loss.backward()`: the
    documented recipe (backward, _backward_epilogue for each, step for each, optimizer.zero_grad
    for each) and the plain one (backward, step for each) must equal a reference that trains all
    models with one backward of the same shared loss on the whole global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed
from models_backward import batches, config, make_net, micro_slice, reference, state_of

STEPS = 3
SEEDS = (0, 1)
FP32_TOL = dict(rtol=1e-6, atol=1e-6)


def train_models(cfg: dict, steps: int, recipe: str, variants: tuple[dict, ...]) -> dict:
    """Runs on every rank: one engine per model (model i built with seed SEEDS[i])."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engines = [deepspeed.initialize(model=make_net(seed, **variant), config=copy.deepcopy(cfg))[0]
               for seed, variant in zip(SEEDS, variants)]
    hook_calls = [0 for _ in engines]
    for i, engine in enumerate(engines):
        def count(i: int = i) -> None:
            hook_calls[i] += 1
        engine.register_grad_acc_post_hook(count)
    micro, gas = engines[0].train_micro_batch_size_per_gpu(), engines[0].gradient_accumulation_steps()
    dtype = engines[0].module.fc1.weight.dtype
    backward_calls = 0
    for x, y in batches(steps, micro * gas * world):
        for k in range(gas):
            xb, yb = micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world)
            losses = [engine(xb, yb) for engine in engines]
            backward_calls += 1
            if recipe == "independent":
                for engine, loss in zip(engines, losses):
                    engine.backward(loss)
                for engine in engines:
                    engine.step()
                continue
            loss = sum(l / (i + 1) for i, l in enumerate(losses))
            loss.backward()
            if recipe == "documented":
                for engine in engines:
                    engine._backward_epilogue()
            for engine in engines:
                engine.step()
            if recipe == "documented":
                for engine in engines:
                    engine.optimizer.zero_grad()
    return {"states": [state_of(e.module) for e in engines], "hook_calls": hook_calls,
            "backward_calls": backward_calls, "global_steps": [e.global_steps for e in engines],
            "skipped": [e.skipped_steps for e in engines]}


def _check(results: list[dict], refs: list[dict], steps: int, tol: dict) -> None:
    for rank, result in enumerate(results):
        # Each engine finished every backward exactly once, however many engines shared it.
        assert result["hook_calls"] == [result["backward_calls"]] * len(refs), f"rank {rank}"
        assert result["global_steps"] == [steps] * len(refs) and result["skipped"] == [0] * len(refs)
        for i, (state, ref) in enumerate(zip(result["states"], refs)):
            for name, value in state.items():
                torch.testing.assert_close(value, ref[name], **tol, msg=f"rank {rank}, model {i}: {name}")
    for state0, state1 in zip(results[0]["states"], results[-1]["states"]):
        for name, value in state0.items():  # replicas stay identical
            torch.testing.assert_close(state1[name], value, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("world,gas", [(1, 2), (2, 1), (2, 2)])
def test_independent_engines_each_match_their_reference(world: int, gas: int) -> None:
    cfg = config(gas=gas)
    results = run_distributed(world, train_models, cfg, STEPS, "independent", ({}, {}))
    refs = [reference(cfg, STEPS, world, seeds=(seed,))[0] for seed in SEEDS]
    assert not torch.allclose(refs[0]["fc1.weight"], refs[1]["fc1.weight"])  # two different models
    _check(results, refs, STEPS, FP32_TOL)


# The documented recipe zeroes gradients after every step() call, so it accumulates nothing
# across micro-steps: it is for gradient_accumulation_steps=1.
@pytest.mark.parametrize("recipe,world,gas", [("documented", 1, 1), ("documented", 2, 1), ("plain", 1, 2),
                                              ("plain", 2, 1), ("plain", 2, 2)])
def test_joint_training_with_shared_loss(recipe: str, world: int, gas: int) -> None:
    cfg = config(gas=gas)
    results = run_distributed(world, train_models, cfg, STEPS, recipe, ({}, {}))
    refs = reference(cfg, STEPS, world, seeds=SEEDS, weights=(1.0, 0.5))
    _check(results, refs, STEPS, FP32_TOL)


def test_joint_training_with_reentrant_checkpointing() -> None:
    """The second model's middle block is checkpointed (reentrant): both engines' epilogues wait
    for the nested backward of the shared loss."""
    cfg = config(gas=2)
    results = run_distributed(2, train_models, cfg, STEPS, "plain", ({}, {"checkpoint": "reentrant"}))
    refs = reference(cfg, STEPS, 2, seeds=SEEDS, weights=(1.0, 0.5))
    _check(results, refs, STEPS, FP32_TOL)


@pytest.mark.parametrize("recipe", ["documented", "independent"])
def test_bf16_multi_model(recipe: str) -> None:
    cfg = config(gas=1, precision="bf16")
    results = run_distributed(2, train_models, cfg, STEPS, recipe, ({}, {}))
    weights = (1.0, 0.5) if recipe == "documented" else (1.0,)
    refs = reference(cfg, STEPS, 2, seeds=SEEDS, weights=weights) if recipe == "documented" else \
        [reference(cfg, STEPS, 2, seeds=(seed,))[0] for seed in SEEDS]
    # Measured 1.5e-3 from the fp32 reference; weighting model 1 by 1 instead of 1/2 moves it by 6.6e-2.
    _check(results, refs, STEPS, dict(rtol=0.0, atol=6e-3))
