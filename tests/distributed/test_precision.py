"""fp16 loss scaling, bf16 with fp32 gradient accumulation, torch_autocast communication dtypes."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import TinyMLP, global_batches, make_model, micro_slice, reference_training
from models_zero import AutocastNet

FP16 = {"enabled": True, "auto_cast": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 2}


def _config(gas: int = 1, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


def fp16_overflow_run(poison_step: int) -> dict:
    """Rank 1 feeds inf at `poison_step`: every rank must skip that step and lower the scale."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=_config(fp16=FP16))
    scales, applied, params_before, params_after = [], [], None, None
    for step, (x, y) in enumerate(global_batches(6, 2 * world)):
        xb, yb = micro_slice(x, 2, 0, rank, world), micro_slice(y, 2, 0, rank, world)
        if step == poison_step and rank == 1:
            xb = xb * float("inf")
        if step == poison_step:
            params_before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(xb, yb))
        engine.step()
        if step == poison_step:
            params_after = [p.detach().clone() for p in engine.module.parameters()]
        scales.append(opt.loss_scale)
        applied.append(engine.was_step_applied())
    unchanged = all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    dtypes = {p.dtype for p in engine.module.parameters()}
    return {"scales": scales, "applied": applied, "skipped": engine.skipped_steps, "unchanged": unchanged,
            "finite": finite, "dtypes": dtypes, "global_steps": engine.global_steps}


def test_fp16_overflow_skips_step_on_every_rank_and_lowers_scale() -> None:
    results = run_distributed(2, fp16_overflow_run, 2)
    for r in results:
        assert r["applied"] == [True, True, False, True, True, True]
        assert r["unchanged"] and r["finite"] and r["skipped"] == 1 and r["global_steps"] == 6
        assert r["dtypes"] == {torch.float16}
        # DeepSpeed's rule (docs/precision.md): with window 2 the scale doubles on the 3rd clean step
        # after an overflow (stable = cur_iter - last_overflow_iter - 1 reaches 2); hysteresis 1 halves it
        assert r["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert results[0]["scales"] == results[1]["scales"]


def fp16_stuck_at_min_scale() -> str:
    import deepspeed

    cfg = _config(fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 1, "min_loss_scale": 1,
                          "hysteresis": 1})
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    try:
        for _ in range(5):
            engine.backward(engine(torch.full((2, 16), float("nan")), torch.tensor([0, 1])))
            engine.step()
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_fp16_error_instead_of_endless_skips_at_min_scale() -> None:
    message = run_distributed(1, fp16_stuck_at_min_scale)[0]
    assert "LossScaleAtMinimumError" in message and "min_loss_scale" in message


def train_low_precision(config: dict, steps: int) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    gas = engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype  # bf16 has no auto_cast: inputs are cast by the user
    first_grads = None
    for x, y in global_batches(steps, 2 * gas * world):
        for k in range(gas):
            xb = micro_slice(x, 2, k, rank, world).to(dtype)
            engine.backward(engine(xb, micro_slice(y, 2, k, rank, world)))
            if first_grads is None and engine.is_gradient_accumulation_boundary():
                first_grads = {n: engine._reducer.grad_view(p).float().clone()
                               for n, p in engine.module.named_parameters()}
            engine.step()
    state = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    return {"state": state, "first_grads": first_grads}


def test_bf16_training_tracks_fp32_reference() -> None:
    config = _config(gas=2, bf16={"enabled": True})
    results = run_distributed(2, train_low_precision, config, 4)
    _, ref_state, _ = reference_training(config, 4, 2)
    for name, ref in ref_state.items():
        torch.testing.assert_close(results[0]["state"][name], ref.float(), rtol=3e-2, atol=2e-2, msg=name)
        torch.testing.assert_close(results[0]["state"][name], results[1]["state"][name], rtol=0, atol=0)


def exact_sum_of_bf16_micro_grads(gas: int) -> dict:
    """The bf16 model's micro-batch gradients (each computed in bf16) summed exactly in fp64."""
    model = make_model().to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for x, y in global_batches(1, 2 * gas):
        for k in range(gas):
            model.zero_grad()
            loss = model(micro_slice(x, 2, k, 0, 1).to(torch.bfloat16), micro_slice(y, 2, k, 0, 1)) / gas
            loss.backward()
            for n, p in model.named_parameters():
                total[n] = total.get(n, torch.zeros(p.shape, dtype=torch.float64)) + p.grad.double()
    return total


def test_fp32_accumulation_is_closer_to_exact_than_bf16_accumulation() -> None:
    exact = exact_sum_of_bf16_micro_grads(8)
    errors = {}
    for accum in ("fp32", "bf16"):
        config = _config(gas=8, bf16={"enabled": True}, data_types={"grad_accum_dtype": accum})
        grads = run_distributed(1, train_low_precision, config, 1)[0]["first_grads"]
        errors[accum] = sum((grads[n].double() - g).norm().item() for n, g in exact.items())
    assert errors["fp32"] < 0.25 * errors["bf16"], errors


def autocast_bytes_by_dtype() -> dict:
    import deepspeed
    import deepspeed.comm as dist

    torch.manual_seed(0)
    cfg = _config(torch_autocast={"enabled": True, "dtype": "bfloat16"})
    engine, *_ = deepspeed.initialize(model=AutocastNet(), config=cfg)
    dist.comms_counter.reset()
    dist.comms_counter.keep_records = True
    engine.backward(engine(torch.randn(2, 16), torch.tensor([0, 3])))
    engine.step()
    by_dtype: dict[str, int] = {}
    for record in dist.comms_counter.records:
        if record.op == "all_reduce":
            by_dtype[record.dtype] = by_dtype.get(record.dtype, 0) + record.nbytes
    dist.comms_counter.keep_records = False
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    return {"bytes": by_dtype, "param_dtypes": dtypes}


def test_torch_autocast_reduces_safe_modules_in_autocast_dtype() -> None:
    result = run_distributed(2, autocast_bytes_by_dtype)[0]
    model = AutocastNet()
    linear = sum(p.numel() for m in (model.fc, model.head) for p in m.parameters())
    norm = sum(p.numel() for p in model.norm.parameters())
    assert result["bytes"] == {"torch.bfloat16": 2 * linear, "torch.float32": 4 * norm}
    assert set(result["param_dtypes"].values()) == {torch.float32}  # parameters stay fp32


def test_autocast_with_fp16_section_is_a_config_error() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="torch_autocast"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"enabled": True},
                         "bf16": {"enabled": True}}, world_size=1)


def scaler_attributes() -> list:
    import deepspeed

    out = []
    for stage in (0, 1, 2, 3):
        for fp16 in ({"enabled": True, "loss_scale": 138.0}, {"enabled": True}):
            engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=_config(
                fp16=fp16, zero_optimization={"stage": stage}))
            view = opt.loss_scale_config   # upstream's newer name for the same state
            assert (view.dynamic_loss_scale, view.cur_scale) == (opt.dynamic_loss_scale, opt.loss_scaler.loss_scale)
            out.append((stage, fp16.get("loss_scale", 0.0), opt.dynamic_loss_scale, opt.loss_scaler.loss_scale))
    return out


def test_optimizer_reports_static_and_dynamic_loss_scale_as_upstream() -> None:
    """`optimizer.dynamic_loss_scale` / `optimizer.loss_scaler.loss_scale` (upstream's names, read by
    its tests and by frameworks logging the scale), at every stage."""
    for stage, configured, dynamic, scale in run_distributed(1, scaler_attributes)[0]:
        if configured:
            assert (dynamic, scale) == (False, configured), stage
        else:
            assert dynamic and scale == 2.0 ** 16, stage   # initial_scale_power default 16
