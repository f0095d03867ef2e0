"""Generation between training steps at ZeRO-3: `deepspeed.runtime.zero.unwrap_model_for_generation`
and the hand-written equivalent RL libraries (TRL's remove_hooks/add_hooks, before and since TRL 1.16)
run through upstream's `optimizer.parameter_offload`. Inside: every parameter whole, no ZeRO-3 hook left, a forward issues no
all-gather; after: training goes on exactly as plain PyTorch's."""

from __future__ import annotations

import itertools

import torch

import deepspeed
from deepspeed.runtime.zero import unwrap_model_for_generation
from harness import run_distributed
from models import TinyMLP, reference_training
from test_engine_dp import _config, train_engine
from test_zero3_engine import _assert_close_to, _z3


def _trl_offload(engine):
    """TRL's choice of hook holder: the training optimizer's `parameter_offload`, else `engine.optimizer`
    itself (upstream's DeepSpeedZeRoOffload for an engine built without an optimizer)."""
    if engine.optimizer is not None and hasattr(engine.optimizer, "parameter_offload"):
        return engine.optimizer.parameter_offload
    if engine.optimizer is not None:
        return engine.optimizer
    raise RuntimeError("The model optimizer is None, which is not yet supported.")


def _trl_remove_hooks(engine) -> None:
    """TRL's remove_hooks, as RL libraries copy it (reads upstream's names only)."""
    offload = _trl_offload(engine)
    params = itertools.chain(offload.module.named_parameters(recurse=True), offload.module.ds_external_parameters())
    for _, param in params:
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _trl_add_hooks(engine) -> None:
    """TRL < 1.16 (and its copies, e.g. LLaMA-Factory's pinned TRL) with DeepSpeed < 0.16.4."""
    offload = _trl_offload(engine)
    offload._register_hooks_recursively(offload.module)


def _trl_116_add_hooks(engine) -> None:
    """TRL 1.16.0's add_hooks, verbatim in what it reads (trl/models/utils.py)."""
    offload = _trl_offload(engine)
    if hasattr(offload, "param_coordinator"):
        coordinator = offload.param_coordinator
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        assert coordinator.is_invalid_trace()
    offload._register_deepspeed_module(offload.module)


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def generate_between_steps(model, step: int) -> None:
    """Step 1: unwrap_model_for_generation; step 2: TRL's by-hand version, step 3 TRL 1.16's. The plain
    model (the reference run) goes through the same context as a no-op."""
    if step not in (1, 2, 3):
        return
    module = getattr(model, "module", model)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
    engine = model if hasattr(model, "module") else None
    hooked = _hooks(module)
    if engine is not None:
        stats = engine.optimizer.coordinator.stats
        assert hooked > 0 and module.fc1.weight.numel() == 0   # partitioned between steps
    if step == 1:
        with unwrap_model_for_generation(model) as unwrapped:
            assert unwrapped is model
            assert _hooks(module) == 0 and module.fc1.weight.shape == (32, 16)
            gathers = stats.sync if engine is not None else 0
            with torch.no_grad():
                out = module(x)
            assert (stats.sync if engine is not None else 0) == gathers   # nothing gathered per layer
    else:
        if engine is None:
            with torch.no_grad():
                out = module(x)
        else:
            with deepspeed.zero.GatheredParameters(model.parameters()):
                _trl_remove_hooks(model)
                assert _hooks(module) == 0
                with torch.no_grad():
                    out = module(x)
                (_trl_add_hooks if step == 2 else _trl_116_add_hooks)(model)
    assert out.shape == (5, 4) and torch.isfinite(out).all()
    assert _hooks(module) == hooked
    if engine is not None:
        assert module.fc1.weight.numel() == 0   # released again


def test_generation_between_steps_then_training_matches_plain_pytorch() -> None:
    config = _config(micro=1, gas=2, zero_optimization=_z3())
    results = run_distributed(2, train_engine, config, 5, "engine", TinyMLP, generate_between_steps)
    ref_losses, ref_state, _ = reference_training(config, 5, 2, edit=generate_between_steps)
    _assert_close_to(results, ref_losses, ref_state)
    # the same engine without generating: the same kernels in the same order, so bit-equal
    plain = run_distributed(2, train_engine, config, 5, "engine", TinyMLP)
    for r, p in zip(results, plain):
        assert r["losses"] == p["losses"]
        assert all(torch.equal(r["state"][k], p["state"][k]) for k in p["state"])


def other_stages(stage: int) -> bool:
    engine, *_ = deepspeed.initialize(model=TinyMLP(), config=_config(zero_optimization={"stage": stage}))
    with unwrap_model_for_generation(engine) as unwrapped:
        return unwrapped is engine and engine.module.fc1.weight.shape == (32, 16)


def test_other_stages_yield_the_engine_unchanged() -> None:
    for stage in (0, 1, 2):
        assert run_distributed(1, other_stages, stage) == [True]


def generate_with_inference_engine() -> list:
    """TRL's GKD teacher and A2PO reference model, LLaMA-Factory's PPO reward model: a ZeRO-3 engine
    built without an optimizer goes through TRL's unwrap flow, which then takes `engine.optimizer`
    itself as the hook holder (upstream: DeepSpeedZeRoOffload; here: the same view)."""
    config = _config(zero_optimization=_z3())
    del config["optimizer"]
    engine, optimizer, _, _ = deepspeed.initialize(model=TinyMLP(), config=config)
    assert optimizer is engine.optimizer and not hasattr(optimizer, "parameter_offload")
    module, x = engine.module, torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    hooked = _hooks(module)
    with torch.no_grad():
        before = engine(x)
        with deepspeed.zero.GatheredParameters(engine.parameters()):
            _trl_remove_hooks(engine)
            inside = module(x) if _hooks(module) == 0 else None
            _trl_116_add_hooks(engine)
        after = engine(x)
    with unwrap_model_for_generation(engine) as unwrapped:      # ours takes the same view
        assert _hooks(module) == 0 and unwrapped is engine
    return [torch.equal(before, inside), torch.equal(before, after), _hooks(module) == hooked,
            module.fc1.weight.numel()]


def test_trl_generation_with_an_engine_without_optimizer() -> None:
    assert run_distributed(2, generate_with_inference_engine) == [[True, True, True, 0]] * 2
