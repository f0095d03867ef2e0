"""Low-precision ZeRO master weights and gradients (fp16/bf16 `*_master_weights_and_grads`,
`bf16_optimizer_states`) on real gloo ranks, against a plain-PyTorch loop that keeps the same dtypes.

Both ranks see the same batch, so the data-parallel average of two equal bf16 gradients is exact and
the reference is one process: a bf16 model whose bf16 gradients accumulate in `.grad` over the
micro-steps, and the same optimizer class stepping bf16 master weights (a copy of the parameters).
The trained parameters must match bit for bit; the bytes each rank holds per parameter of its
partition are counted (master, gradient the optimizer reads, optimizer moments)."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed

STEPS, GAS, MICRO = 3, 2, 4
DIM = 16
SCALE_POWER = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def _batches(rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(STEPS * GAS)]


def _config(stage: int, dtype: str = "bf16", states: bool = False, offload: bool = True,
            fp32_states: bool | None = None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 300}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    params: dict = {"lr": 1e-2, "weight_decay": 0.01}
    if fp32_states is not None:
        params["fp32_optimizer_states"] = fp32_states
    section: dict = {"enabled": True, f"{dtype}_master_weights_and_grads": True}
    if states:
        section["bf16_optimizer_states"] = True
    if dtype == "fp16":
        section["initial_scale_power"] = SCALE_POWER   # fp16 gradients overflow at the default 2**16
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero, dtype: section,
            "steps_per_print": 1000}


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _shards(engine) -> list:
    opt = engine.optimizer
    return list(getattr(opt, "units", None) or opt.buckets)


def _bytes(engine) -> dict:
    """Bytes this rank holds per element of its master partition, by kind."""
    shards = _shards(engine)
    numel = sum(s.master.numel() for s in shards)
    master = sum(s.master.numel() * s.master.element_size() for s in shards)
    grad = sum(s.grad.numel() * s.grad.element_size() for s in shards)
    states = sum(v.numel() * v.element_size() for st in engine.optimizer.optimizer.state.values()
                 for k, v in st.items() if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq"))
    frag = sum(m.numel() for s in shards for m, _ in s.fragment_masters)
    return {"master": master / numel, "grad": grad / numel, "states": states / frag,
            "dtypes": sorted({str(s.master.dtype) for s in shards} | {str(s.grad.dtype) for s in shards}),
            "master_device": sorted({s.master.device.type for s in shards})}


def _train(engine, batches) -> None:
    for x, y in batches:
        loss = _loss(engine, x, y)   # through the engine's forward
        engine.backward(loss)
        engine.step()


def _params(engine) -> dict:
    """The whole parameters (gathered at ZeRO-3), in the model's dtype."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone() for n, p in params.items()}


def _train_job(config: dict, save_dir: str | None = None, per_rank: bool = False) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=copy.deepcopy(config))
    batches = _batches(dist.get_rank() if per_rank else 0)
    half = STEPS // 2 * GAS
    _train(engine, batches[:half])
    out: dict = {}
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
        out["at_save"] = _params(engine)
    _train(engine, batches[half:])
    out["bytes"] = _bytes(engine)
    out["state"] = _params(engine)
    if save_dir is not None:   # resume from the checkpoint in a fresh engine: same result
        fresh, _, _, _ = deepspeed.initialize(model=_model(), config=copy.deepcopy(config))
        fresh.load_checkpoint(save_dir, tag="t")
        out["resumed_bytes"] = _bytes(fresh)
        _train(fresh, batches[half:])
        out["resumed"] = _params(fresh)
        dist.barrier()
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            out["consolidated"] = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
    return out


def _reference_two_ranks(config: dict, steps: int, clip: float, every_micro: bool) -> dict:
    """Each rank's batches differ: the two bf16 gradients are averaged in bf16 (at the boundary, or at
    every micro-step and then accumulated: `every_micro`), clipped by the
    global norm (fp32 sum of squares) and stepped by the same optimizer on bf16 masters."""
    from deepspeed.ops.adam import FusedAdam

    models = [_model().to(torch.bfloat16) for _ in range(2)]
    masters = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    opt = FusedAdam(masters, **config["optimizer"]["params"])
    batches = [_batches(r) for r in range(2)]
    for step in range(steps):
        grads = None
        for micro in range(step * GAS, (step + 1) * GAS):
            for model, mine in zip(models, batches):
                (_loss(model, *mine[micro]) / GAS).backward()
            if every_micro or micro == (step + 1) * GAS - 1:   # ZeRO-2/3 reduce at every backward
                reduced = [(a.grad + b.grad) * 0.5 for a, b in zip(*(m.parameters() for m in models))]
                grads = reduced if grads is None else [g + r for g, r in zip(grads, reduced)]
                for model in models:
                    model.zero_grad()
        norm = float(torch.stack([g.float().pow(2).sum() for g in grads]).sum()) ** 0.5
        coef = clip / (norm + 1e-6)
        for m, g in zip(masters, grads):
            m.grad = g.mul_(coef) if coef < 1.0 else g
        opt.step()
        for model in models:
            for m, p in zip(masters, model.parameters()):
                p.data.copy_(m.data)
                p.grad = None
    return {n: p.detach().clone() for n, p in models[0].named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_different_batches_per_rank_and_clipping(stage: int) -> None:
    """The data-parallel average and the global-norm clipping on bf16 gradients (the order of the
    additions differs from the reference's: bf16 tolerance)."""
    config = _config(stage, "bf16", states=True, offload=False)
    config["gradient_clipping"] = 0.05
    ref = _reference_two_ranks(config, STEPS, 0.05, every_micro=stage > 1)
    for r in run_distributed(2, _train_job, config, None, True):
        for name, value in ref.items():
            torch.testing.assert_close(r["state"][name], value, msg=name)   # bf16: rtol 1.6e-2
        assert any(not torch.equal(r["state"][n], v) for n, v in _reference(config, STEPS).items())


def _reference(config: dict, steps: int) -> dict:
    """Plain PyTorch with the same dtypes: bf16/fp16 parameters and gradients (accumulated in
    `.grad`), the same optimizer class on low-precision master copies."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    dtype = torch.bfloat16 if "bf16" in config else torch.float16
    model = _model().to(dtype)
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    bf16_states = config.get("bf16", {}).get("bf16_optimizer_states", False)
    offload = "offload_optimizer" in config["zero_optimization"]
    params = dict(config["optimizer"]["params"])
    params.pop("fp32_optimizer_states", None)
    if offload:
        opt = DeepSpeedCPUAdam(masters, **params, fp32_optimizer_states=not bf16_states)
    else:
        opt = FusedAdam(masters, **params)
    batches = _batches()
    scale = 2.0 ** SCALE_POWER if dtype == torch.float16 else 1.0   # fp16: the loss scale, powers of two
    for step in range(steps):
        for x, y in batches[step * GAS:(step + 1) * GAS]:
            (_loss(model, x, y) * scale / GAS).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.mul_(1.0 / scale)
        opt.step()
        for m, p in zip(masters, model.parameters()):
            p.data.copy_(m.data)
            p.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = {   # name: (dtype, bf16 states, offload, master bytes, grad bytes, state bytes per element)
    "bf16-offload": ("bf16", False, True, 2, 2, 8),
    "bf16-states-offload": ("bf16", True, True, 2, 2, 4),
    "bf16-states-device": ("bf16", True, False, 2, 2, 4),
    "fp16-offload": ("fp16", False, True, 2, 2, 8),
}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_low_precision_masters_match_reference_and_bytes(stage: int, case: str) -> None:
    dtype, states, offload, master_b, grad_b, state_b = CASES[case]
    _check_against_reference(_config(stage, dtype, states, offload), dtype, master_b, grad_b, state_b)


def test_stage3_with_parameter_offload() -> None:
    config = _config(3, "bf16", states=False, offload=True)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    _check_against_reference(config, "bf16", 2, 2, 8)


def _check_against_reference(config: dict, dtype: str, master_b: int, grad_b: int, state_b: int) -> None:
    results = run_distributed(2, _train_job, config)
    ref = _reference(config, STEPS)
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    for r in results:
        assert r["bytes"]["master"] == master_b and r["bytes"]["grad"] == grad_b, r["bytes"]
        assert r["bytes"]["states"] == state_b, r["bytes"]
        assert r["bytes"]["dtypes"] == [str(want)], r["bytes"]
        assert r["bytes"]["master_device"] == ["cpu"]
        for name, value in ref.items():
            assert r["state"][name].dtype == want
            assert torch.equal(r["state"][name], value), (name, (r["state"][name].float() - value.float()).abs().max())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_resumes_and_consolidates(stage: int, tmp_path) -> None:
    config = _config(stage, "bf16", states=True, offload=True)
    results = run_distributed(2, _train_job, config, str(tmp_path))
    for r in results:
        assert r["resumed_bytes"] == r["bytes"]   # same dtypes and layout after the load
        for name, value in r["state"].items():
            assert torch.equal(r["resumed"][name], value), name
    consolidated = results[0]["consolidated"]
    model = _model()
    assert set(consolidated) == {n for n, _ in model.named_parameters()}
    for name, value in consolidated.items():   # the bf16 masters, exactly, as fp32
        assert value.dtype == torch.float32
        assert torch.equal(value, results[0]["at_save"][name].float()), name


def _init_error(config: dict, client: str | None = None) -> str:
    import deepspeed

    optimizer = None
    model = _model()
    if client == "cpu_adam_fp32":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3)
        config = {k: v for k, v in config.items() if k != "optimizer"}
    elif client == "torch_adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        config = {k: v for k, v in config.items() if k != "optimizer"}
    try:
        deepspeed.initialize(model=model, config=copy.deepcopy(config), optimizer=optimizer)
    except Exception as exc:   # noqa: BLE001 - the test compares types and messages
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_validation_rules_on_every_rank() -> None:
    both = _config(1, "bf16")
    both["fp16"] = {"enabled": False, "fp16_master_weights_and_grads": True}
    no_offload = _config(2, "bf16", states=False, offload=False)
    fp16_no_offload = _config(1, "fp16", offload=False)
    states_offload_client = _config(2, "bf16", states=True, offload=True)
    stage3 = _config(3, "bf16", states=False, offload=False)
    cases = [(both, None, "mutually exclusive"),
             (no_offload, None, "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam. "
                                "Current ZeRO-Offload:False optimizer type FusedAdam"),
             (fp16_no_offload, None, "Master weights feature requires ZeRO-1 Offload with DeepSpeedCPUAdam"),
             (_config(1, "bf16", offload=True), "torch_adam", "optimizer type Adam"),
             (states_offload_client, "cpu_adam_fp32", "bf16_optimizer_states with ZeRO-Offload requires "
                                                      "DeepSpeedCPUAdam constructed with fp32_optimizer_states=False"),
             (stage3, None, "Master weights feature requires ZeRO-3 Offload with DeepSpeedCPUAdam. "
                            "Current ZeRO-3 Offload:False optimizer type FusedAdam")]
    for config, client, message in cases:
        for err in run_distributed(2, _init_error, config, client):
            assert message in err, (message, err)
    # a config-built CPU Adam is given bf16 moments (the user's fp32_optimizer_states=True overridden)
    assert run_distributed(2, _init_error, _config(1, "bf16", True, True, fp32_states=True)) == ["ok", "ok"]


def _fp32_accum_job(stage: int) -> dict:
    import deepspeed

    config = _config(stage, "bf16", states=True, offload=False)
    config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    accum = {str(s.grad_source.dtype) for s in _shards(engine)}
    _train(engine, _batches()[:GAS])
    engine.offload_states()   # and back: the bf16 masters and moments keep their dtype
    engine.reload_states()
    _train(engine, _batches()[GAS:])
    return {"accum": accum, "bytes": _bytes(engine), "state": _params(engine)}


def test_fp32_accumulation_override_and_offload_states() -> None:
    """`data_types.grad_accum_dtype: "fp32"` accumulates in fp32 while the optimizer reads a bf16
    copy; engine.offload_states / reload_states keep the 16-bit partitions. All stages agree."""
    runs = {stage: run_distributed(2, _fp32_accum_job, stage)[0] for stage in (1, 2, 3)}
    for stage, r in runs.items():
        assert r["accum"] == {"torch.float32"}, (stage, r["accum"])
        assert (r["bytes"]["master"], r["bytes"]["grad"], r["bytes"]["states"]) == (2, 2, 4), r["bytes"]
        for name, value in runs[1]["state"].items():
            assert torch.equal(r["state"][name], value), (stage, name)
