"""FLOPs profiler (deepspeed.profiling.flops_profiler): exact matmul FLOPs of the example GPT, forward
and measured backward, against the closed-form count and the 6·N·tokens rule; per-module numbers;
upstream's number formats and report layout; and profiling leaves torch and the model as they were."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch

from deepspeed.profiling.flops_profiler import (FlopsProfiler, duration_to_string, get_model_profile, macs_to_string,
                                                number_to_string, params_to_string)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from models_zero3 import _gpt_module  # noqa: E402

B, T, C, L, V = 2, 16, 32, 2, 64


def tiny_gpt() -> torch.nn.Module:
    gpt = _gpt_module()
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=2, n_embd=C))


def linear_weights(model: torch.nn.Module) -> int:
    """N of the 6·N·tokens rule: the parameters that multiply activations (the tied LM head once)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_gpt_forward_flops_are_exact_matmul_flops():
    model = tiny_gpt()
    tokens = torch.randint(0, V, (B, T))
    flops, macs, params = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)
    per_layer = 2 * B * T * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + 2 * (2 * B * T * T * C)  # linears + QK^T, AV
    assert flops == L * per_layer + 2 * B * T * C * V and macs == flops // 2
    assert params == sum(p.numel() for p in model.parameters())
    assert flops == 2 * linear_weights(model) * B * T + 4 * L * B * T * T * C   # 2·N·tokens + attention


def test_per_module_rows_and_tree():
    model = tiny_gpt()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randint(0, V, (B, T)))
    prof.stop_profile()
    root = prof.module_rows()
    rows = {}

    def walk(row):
        rows[row.name] = row
        for child in row.children:
            walk(child)

    walk(root)
    assert rows["blocks.0.mlp.fc"].flops == 2 * B * T * C * 4 * C and rows["blocks.0.mlp.fc"].params == C * 4 * C + 4 * C
    assert rows["blocks.0.attn"].flops == 2 * B * T * 4 * C * C + 4 * B * T * T * C   # qkv + proj + attention
    assert rows["blocks"].flops == sum(rows[f"blocks.{i}"].flops for i in range(L))  # a ModuleList sums its children
    assert rows["blocks.0.ln1"].flops == 0 and rows["blocks.0.attn.qkv"].duration > 0
    assert root.duration >= rows["blocks"].duration > 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        prof.print_model_profile(profile_step=3, top_modules=2)
    text = out.getvalue()
    prof.end_profile()
    for needle in ("Profile Summary at step 3:", "fwd MACs per GPU:", f"fwd flops per GPU:{' ' * 50}",
                   "Top 2 modules in terms of params, MACs or fwd latency at different model depths:", "depth 3:",
                   "(blocks): ModuleList(", "(fc): Linear(", "in_features=32, out_features=128, bias=True)"):
        assert needle in text, needle
    assert not prof.started and prof.module_rows().flops == 0     # end_profile drops the per-module results
    assert prof.get_total_flops() == root.flops                    # the totals stay, as upstream's attributes


def test_upstream_number_formats():
    assert params_to_string(34176) == "34.18 K" and params_to_string(1.5e9) == "1.5 B"
    assert macs_to_string(2560) == "2.56 KMACs" and macs_to_string(0) == "0 MACs"
    assert duration_to_string(0.000182) == "182 us" and duration_to_string(1.25) == "1.25 s"
    assert number_to_string(5.25e12) == "5.25 T" and number_to_string(3e-3) == "3 m"


def test_conv_model_with_input_shape():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10))
    flops, macs, params = get_model_profile(model, input_shape=(4, 3, 6, 6), print_profile=False, as_string=False)
    assert flops == 2 * 4 * 8 * 3 * 9 * 36 + 2 * 4 * 288 * 10
    assert get_model_profile(model, input_shape=(4, 3, 6, 6), print_profile=False) == (
        number_to_string(flops), macs_to_string(macs), params_to_string(params))


def _global_state() -> dict:
    import torch.nn.modules.module as module_mod

    hooks = {name: dict(getattr(module_mod, name)) for name in dir(module_mod)
             if name.startswith("_global_") and isinstance(getattr(module_mod, name), dict)}
    functions = {f"{ns.__name__}.{k}": id(v) for ns in (torch, torch.nn.functional, torch.Tensor)
                 for k, v in list(vars(ns).items()) if callable(v)}
    return {"hooks": hooks, "functions": functions, "modes": torch._C._len_torch_dispatch_stack()}


def _model_state(model: torch.nn.Module) -> list:
    return [(name, type(m), sorted(vars(m)), dict(m._forward_hooks), dict(m._forward_pre_hooks),
             dict(m._backward_hooks), m.training) for name, m in model.named_modules()]


def test_profiling_leaves_torch_and_the_model_unchanged(tmp_path):
    model = tiny_gpt()
    model.train()
    tokens = torch.randint(0, V, (B, T))
    torch_before, model_before = _global_state(), _model_state(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    get_model_profile(model, args=[tokens], output_file=str(tmp_path / "report.txt"))
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(tokens, tokens)
    prof.stop_profile()
    loss.backward()                       # a graph built while profiling carries no profiler hooks
    prof.end_profile()
    assert _global_state() == torch_before
    assert _model_state(model) == model_before            # training flag restored by get_model_profile too
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert "Profile Summary at step 1:" in (tmp_path / "report.txt").read_text()


def test_engine_profile_measures_training_flops_and_the_6n_rule(tmp_path):
    """The engine counts step 1's forward and backward: forward + backward FLOPs per sample equal
    6·N·tokens plus attention's (4 forward + 10 backward)·B·T²·C per layer, within 10% of 6·N·tokens."""
    import deepspeed

    model = tiny_gpt()
    n, before = linear_weights(model), _model_state(model)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 2, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(tmp_path / "flops.txt")}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(8):
        tokens = torch.randint(0, V, (B, T)).to(engine.device)
        engine.backward(engine(tokens, tokens))
        engine.step()
    per_micro_batch = engine.tput_timer.flops_per_sample * B
    assert per_micro_batch == 6 * n * B * T + (4 + 10) * L * B * T * T * C
    assert abs(per_micro_batch / (6 * n * B * T) - 1) < 0.10
    assert engine.tput_timer.avg_tflops_per_sec() > 0
    report = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 1:" in report and "bwd flops per GPU (measured):" in report
    assert report.count("DeepSpeed Flops Profiler") == 1       # once, not once per micro-batch
    engine.destroy()
    assert _model_state(model) == before   # the profiler's hooks are gone


@pytest.mark.parametrize("bad", [{"input_shape": [2, 3]}, {}])
def test_get_model_profile_argument_errors(bad):
    with pytest.raises(ValueError):
        get_model_profile(torch.nn.Linear(3, 3), print_profile=False, **bad)
