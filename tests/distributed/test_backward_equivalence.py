"""engine.backward(loss), loss.backward() and out.backward(grad) train identically.

See [Note: PyTorch-compatible backward] in deepspeed/runtime/backward_hooks.py. Each worker call
trains one fresh engine per backward style on the same global batches (ranks take micro
slices, as in test_engine_dp.py) and returns the final weights plus what the engine's
grad-acc post hook saw. The optimizer is SGD with momentum, which (unlike Adam) changes when a
gradient factor such as 1/gradient_accumulation_steps or the loss scale is applied twice or
not at all.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from harness import run_distributed
from models_backward import Net, batches, ce_grad, config, make_net, micro_slice, reference, state_of

STEPS = 3
ALL_STYLES = ("engine", "torch", "nonscalar", "scale", "torch_epilogue")
# Mixed precision: the styles differ only in where the gradient enters the graph, so the
# loss-driven ones agree bit for bit; `nonscalar` feeds an analytic dloss/dlogits that differs
# from autograd's low-precision cross-entropy gradient by rounding.
EXACT = dict(rtol=0.0, atol=0.0)
# Measured: nonscalar vs engine 1.1e-3 (bf16) / 1.8e-4 (fp16); mixed precision vs the fp32
# reference 1.6e-3 / 2.7e-4. A gradient off by a factor 2 (1/gas twice at gas=2) moves the
# weights by about 5e-2, a loss scale applied twice by far more.
NONSCALAR_TOL = {"fp32": dict(rtol=1e-6, atol=1e-6), "bf16": dict(rtol=0.0, atol=4e-3),
                 "fp16": dict(rtol=0.0, atol=1e-3)}
REFERENCE_TOL = {"fp32": dict(rtol=1e-6, atol=1e-6), "bf16": dict(rtol=0.0, atol=6e-3),
                 "fp16": dict(rtol=0.0, atol=1.5e-3)}


def _grads(engine) -> list[torch.Tensor | None]:
    """The accumulated gradient of every parameter (the fp32 bucket under mixed precision)."""
    reducer = engine._reducer
    if reducer is not None and reducer.accum_dtype not in (None, engine.module.fc1.weight.dtype):
        return [reducer.grad_view(p) for p in engine.module.parameters()]
    return [p.grad for p in engine.module.parameters()]


def train_styles(cfg: dict, steps: int, styles: tuple[str, ...], variant: dict) -> dict[str, dict]:
    """Runs on every rank: one engine per style, trained on the same batches."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for style in styles:
        engine, *_ = deepspeed.initialize(model=make_net(**variant), config=copy.deepcopy(cfg))
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        dtype = engine.module.fc1.weight.dtype
        seen: list[bool] = []  # per epilogue: were all gradients there when the post hook ran?

        def post_hook(engine=engine, seen=seen) -> None:
            seen.append(all(g is not None and bool(g.abs().sum() > 0) for g in _grads(engine)))

        engine.register_grad_acc_post_hook(post_hook)
        backward_calls, repeat_epilogue_effects = 0, []
        for x, y in batches(steps, micro * gas * world):
            for k in range(gas):
                xb, yb = micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world)
                if style == "nonscalar":
                    out = engine(xb)
                    out.backward(ce_grad(out, yb))
                else:
                    loss = engine(xb, yb)
                    if style == "engine":
                        engine.backward(loss)
                    elif style == "scale":
                        engine.scale(loss).backward()
                    else:
                        loss.backward()
                backward_calls += 1
                if style == "torch_epilogue":  # the multi-model recipe's extra call must be a no-op
                    hooks_before = len(seen)
                    reductions_before = dist.comms_counter.summary().get("all_reduce", {}).get("count", 0)
                    grads_before = [g.clone() for g in _grads(engine)]
                    engine._backward_epilogue()
                    reductions = dist.comms_counter.summary().get("all_reduce", {}).get("count", 0)
                    changed = any(not torch.equal(a, b) for a, b in zip(grads_before, _grads(engine)))
                    repeat_epilogue_effects.append((len(seen) - hooks_before, reductions - reductions_before,
                                                    changed))
                engine.step()
        masters = None
        if hasattr(engine.optimizer, "master_params"):
            masters = {name: m.detach().float().clone() for (name, _), m in
                       zip(engine.module.named_parameters(), engine.optimizer.master_params())}
        results[style] = {"state": state_of(engine.module), "masters": masters, "backward_calls": backward_calls,
                          "post_hook_calls": len(seen), "grads_complete": seen,
                          "repeat_epilogue_effects": repeat_epilogue_effects,
                          "skipped": engine.skipped_steps, "global_steps": engine.global_steps}
        engine.destroy()
    return results


def _weights(result: dict) -> dict[str, torch.Tensor]:
    """What the optimizer updated: fp32 masters under mixed precision, else the parameters."""
    return result["masters"] if result["masters"] is not None else result["state"]


def _check(results: list[dict], cfg: dict, world: int, precision: str = "fp32") -> None:
    ref = reference(cfg, STEPS, world)[0]
    gas = cfg["gradient_accumulation_steps"]
    for rank, by_style in enumerate(results):
        base = by_style["engine"]
        for style, result in by_style.items():
            where = f"rank {rank}, style {style}"
            # One epilogue per user backward, after every gradient of that backward arrived.
            assert result["backward_calls"] == STEPS * gas, where
            assert result["post_hook_calls"] == result["backward_calls"], where
            assert all(result["grads_complete"]), f"{where}: epilogue ran before the backward finished"
            assert result["skipped"] == 0 and result["global_steps"] == STEPS, where
            for hooks, reductions, changed in result["repeat_epilogue_effects"]:
                assert (hooks, reductions, changed) == (0, 0, False), f"{where}: repeated epilogue was not a no-op"
            tol = NONSCALAR_TOL[precision] if style == "nonscalar" else EXACT
            for name, value in _weights(result).items():
                torch.testing.assert_close(value, _weights(base)[name], **tol, msg=f"{where} vs engine: {name}")
            for name, value in result["state"].items():
                torch.testing.assert_close(value, ref[name], **REFERENCE_TOL[precision],
                                           msg=f"{where} vs plain PyTorch: {name}")
    if world > 1:  # replicas stay identical
        for style in results[0]:
            for name, value in results[0][style]["state"].items():
                torch.testing.assert_close(results[1][style]["state"][name], value, **EXACT)


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_backward_styles_train_identically(precision: str, gas: int) -> None:
    cfg = config(gas=gas, precision=precision)
    results = run_distributed(2, train_styles, cfg, STEPS, ALL_STYLES, {})
    _check(results, cfg, 2, precision)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_backward_styles_single_rank(precision: str) -> None:
    cfg = config(gas=2, precision=precision)
    results = run_distributed(1, train_styles, cfg, STEPS, ALL_STYLES, {})
    _check(results, cfg, 1, precision)


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_activation_checkpointing_matches_plain_model(mode: str, gas: int) -> None:
    """Reentrant checkpointing runs the middle block's backward in a nested backward call: the
    epilogue must still run once, after it (grads_complete), and training must equal the
    non-checkpointed model trained by plain PyTorch."""
    cfg = config(gas=gas)
    results = run_distributed(2, train_styles, cfg, STEPS, ("engine", "torch", "nonscalar", "torch_epilogue"),
                              {"checkpoint": mode})
    _check(results, cfg, 2)


def test_reentrant_checkpointing_bf16_single_rank() -> None:
    cfg = config(gas=2, precision="bf16")
    results = run_distributed(1, train_styles, cfg, STEPS, ("engine", "torch", "scale"), {"checkpoint": "reentrant"})
    _check(results, cfg, 1, "bf16")


@pytest.mark.parametrize("precision,gas,world", [("fp32", 1, 2), ("fp32", 2, 2), ("fp32", 2, 1), ("fp16", 2, 2)])
def test_autograd_function_with_inner_backward(precision: str, gas: int, world: int) -> None:
    """A loss Function that runs torch.autograd.backward inside its forward (TiledFusedLogitsLoss
    style) neither starts nor ends an engine backward; the user's backward does, once."""
    cfg = config(gas=gas, precision=precision)
    results = run_distributed(world, train_styles, cfg, STEPS, ("engine", "torch", "scale", "torch_epilogue"),
                              {"loss": "fused"})
    _check(results, cfg, world, precision)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_head_accumulates_in_forward(world: int) -> None:
    """The head's gradients are accumulated by the inner backward during forward, outside any
    engine backward; they must still be averaged at the boundary. Combined with reentrant
    checkpointing of the middle block."""
    cfg = config(gas=1)
    results = run_distributed(world, train_styles, cfg, STEPS, ("engine", "torch", "torch_epilogue"),
                              {"loss": "fused_head", "checkpoint": "reentrant"})
    _check(results, cfg, world)


# --- a known bug ----------------------------------------------------------------------------------
class LossAndLogits(Net):
    """Returns (loss, logits) like a Hugging Face model output: both are hooked engine outputs."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.mid(torch.relu(self.fc1(x))))
        return F.cross_entropy(logits, y), logits


def train_loss_and_logits(cfg: dict, steps: int, style: str) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=LossAndLogits(), config=copy.deepcopy(cfg))
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = engine.module.fc1.weight.dtype
    for x, y in batches(steps, micro * gas * world):
        for k in range(gas):
            loss, _ = engine(micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world))
            engine.backward(loss) if style == "engine" else loss.backward()
            engine.step()
    return state_of(engine.module)


@pytest.mark.parametrize("precision,gas", [("fp32", 2), ("fp16", 1)])
def test_loss_backward_when_outputs_feed_each_other(precision: str, gas: int) -> None:
    cfg = config(gas=gas, precision=precision)
    ref = reference(cfg, STEPS, 1)[0]
    engine_state = run_distributed(1, train_loss_and_logits, cfg, STEPS, "engine")[0]
    for name, value in engine_state.items():  # engine.backward is right: the bug is in the hook path only
        torch.testing.assert_close(value, ref[name], **REFERENCE_TOL[precision])
    torch_state = run_distributed(1, train_loss_and_logits, cfg, STEPS, "torch")[0]
    for name, value in torch_state.items():
        torch.testing.assert_close(value, ref[name], **REFERENCE_TOL[precision])


def function_transforms_through_engine(stage: int) -> dict:
    """torch.func transforms called on the engine (gas 4): gradients of the function itself, no
    1/gas scaling, no backward bookkeeping; engine.backward + step work afterwards."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    baseline = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    x = torch.randn(8)
    out = {"grad": (torch.func.grad(lambda xi: engine(xi).sum())(x), torch.func.grad(lambda xi: baseline(xi).sum())(x)),
           "jacrev": (torch.func.jacrev(lambda xi: engine(xi))(x), torch.func.jacrev(lambda xi: baseline(xi))(x))}
    batch = torch.stack([x, x + 0.1, x - 0.1])
    out["vmap"] = (torch.func.vmap(torch.func.grad(lambda xi: engine(xi).sum()))(batch),
                   torch.func.vmap(torch.func.grad(lambda xi: baseline(xi).sum()))(batch))
    for _ in range(4):
        engine.backward(engine(x).sum())
        engine.step()
    out = {k: tuple(t.detach() for t in v) for k, v in out.items()}
    out["global_steps"] = engine.global_steps
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_torch_func_transforms_through_engine(stage: int) -> None:
    result = run_distributed(1, function_transforms_through_engine, stage)[0]
    for name in ("grad", "jacrev", "vmap"):
        ours, plain = result[name]
        # same modules, same inputs, same ops: only the engine's hooks could change the result
        torch.testing.assert_close(ours, plain, rtol=0, atol=0, msg=name)
    assert result["global_steps"] == 1
