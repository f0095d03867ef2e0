"""engine.save_16bit_model / _zero3_consolidated_16bit_state_dict at ZeRO stage 3: the weights
gathered one unit at a time are the engine's fp32 masters rounded to the training dtype, and equal
the same model trained at stage 0 (to the dtype's rounding: see [Note: bit equality across stages])."""

from __future__ import annotations

import logging
import os
import weakref

import pytest
import torch
from torch import nn

from harness import run_distributed
from test_engine_dp import _config
from test_model_save import assert_one_rank_save_failed, save_on_rank0_only

STEPS = 3
FROZEN = ("fc2.bias", "frozen.weight", "frozen.bias")


class SaveNet(nn.Module):
    """Several units of sizes that divide by neither 2 nor 4 (parameters straddle ranks), a
    tied output head, a frozen parameter inside a trained unit, a wholly frozen unit and
    buffers (one persistent, one not)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 7)
        self.frozen = nn.Linear(7, 7)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two state_dict names
        self.fc2.bias.requires_grad_(False)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([1.5, 0.5]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc1(self.embed(x))))
        h = self.fc2(h) * self.scale[0] + self.frozen(self.embed(x)) * self.scale[1]
        return nn.functional.cross_entropy(self.head(torch.tanh(h)), y)


# [Note: bit equality across stages]
# Stage 0 and stage 3 compute the same gradients bit for bit here (same graph, and with 2 ranks
# the average is one exact addition and a halving), but the optimizer step does not run on the
# same tensors: stage 0 steps each parameter as its own tensor, stage 3 one flat fp32 shard per
# unit in which a parameter starts at another offset (rank 1 holds the second half of
# `embed.weight` from its shard's first element). Elementwise kernels treat an element
# differently by its position (vector body or scalar tail, with or without fused multiply-add,
# at the vector width the CPU dispatches), so a trained weight may differ by an ulp between the
# stages on one CPU and not on another (seen: the tied embedding on an AVX-512 machine). Only
# values that were moved and not computed (frozen parameters, buffers, a cast of the masters)
# are compared bit for bit; trained weights to fp32's (or bf16's) rounding.


def _train(stage: int, precision: str | None, zero: dict) -> object:
    import deepspeed
    import deepspeed.comm as dist

    torch.manual_seed(0)
    model = SaveNet()
    extra = {precision: {"enabled": True}} if precision else {}
    config = _config(micro=4, zero_optimization={"stage": stage, **zero}, **extra)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        x, y = torch.randint(0, 11, (4,), generator=g), torch.randint(0, 11, (4,), generator=g)
        engine.backward(engine(x, y))
        engine.step()
    return engine


def save_stage0_and_stage3(save_dir: str, precision: str | None, threshold: int, exclude_frozen: bool) -> dict:
    """Trains SaveNet at stage 0 and at stage 3 on the same data; both save their 16-bit weights."""
    engine0 = _train(0, precision, {})
    stage0 = {k: v.detach().clone() for k, v in engine0.module.state_dict().items()}
    engine0.save_16bit_model(os.path.join(save_dir, "stage0"), exclude_frozen_parameters=exclude_frozen)
    zero = {"stage3_param_persistence_threshold": threshold, "stage3_gather_16bit_weights_on_model_save": True}
    engine = _train(3, precision, zero)
    from deepspeed.utils import safe_get_full_fp32_param

    dtype = next(engine0.module.parameters()).dtype  # the training dtype (buffers keep theirs)
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    masters = {n: m.to(dtype) for n, m in masters.items() if m is not None}  # trained parameters
    target = os.path.join(save_dir, "stage3")
    saved = [engine.save_16bit_model(target, exclude_frozen_parameters=exclude_frozen),
             engine.save_16bit_model(target, "model.safetensors", exclude_frozen_parameters=exclude_frozen)]
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen)
    units = [(u.spec.persistent, len(u.partition.fragments(u.rank))) for u in engine._stage3.units]
    released = all(p.numel() == 0 for u in engine._stage3.units if not u.spec.persistent for p in u.params)
    torch.manual_seed(0)
    init = SaveNet().to(torch.bfloat16 if precision else torch.float32).state_dict()
    return {"stage0": stage0, "state": state, "saved": saved, "units": units, "released": released, "init": init,
            "masters": masters}


CASES = [(1, None, 0), (2, None, 0), (2, "bf16", 10_000), (4, None, 80), (4, "bf16", 0)]


@pytest.mark.parametrize("world,precision,threshold", CASES,
                         ids=[f"w{w}-{p or 'fp32'}-persist{t}" for w, p, t in CASES])
def test_save_16bit_model_equals_stage_0(tmp_path, world: int, precision: str | None, threshold: int) -> None:
    from safetensors.torch import load_file

    results = run_distributed(world, save_stage0_and_stage3, str(tmp_path), precision, threshold, False)
    assert all(r["saved"] == [True, True] for r in results)
    assert all(r["state"] is None for r in results[1:])
    r0 = results[0]
    ref = torch.load(tmp_path / "stage0" / "pytorch_model.bin", weights_only=True)
    assert list(ref) == list(r0["stage0"])  # the stage-0 file is module.state_dict()
    files = {"bin": torch.load(tmp_path / "stage3" / "pytorch_model.bin", weights_only=True),
             "safetensors": load_file(str(tmp_path / "stage3" / "model.safetensors")),
             "consolidated": r0["state"]}
    dtype = torch.bfloat16 if precision else torch.float32
    tol = 2e-2 if precision else 1e-6
    for kind, state in files.items():
        if kind == "safetensors":
            assert set(state) == set(ref), kind
        else:
            assert list(state) == list(ref), kind  # same keys, same order
        for name, value in ref.items():
            assert state[name].shape == value.shape and state[name].dtype == value.dtype, (kind, name)
            if name in FROZEN or name == "scale":
                assert torch.equal(state[name], value), (kind, name)  # untouched by training: moved, not computed
            else:  # [Note: bit equality across stages]
                torch.testing.assert_close(state[name], value, rtol=tol, atol=tol, msg=f"{kind} {name}")
            master = r0["masters"].get("embed.weight" if name == "head.weight" else name)
            if master is not None:
                # the masters rounded to the training dtype: one elementwise cast, the same on any CPU
                assert torch.equal(state[name], master), (kind, name)
            if value.is_floating_point():   # parameters in the training dtype; buffers keep theirs
                assert value.dtype == (torch.float32 if name == "scale" else dtype), name
    assert set(r0["masters"]) == {n for n in ref if n not in FROZEN + ("scale", "head.weight")}
    trained = [n for n in ref if n not in FROZEN and n != "scale"]
    assert all(not torch.equal(ref[n], r0["init"][n]) for n in trained), "training changed nothing"
    assert torch.equal(files["bin"]["head.weight"], files["bin"]["embed.weight"])
    persistent = {p for p, _ in r0["units"]}
    assert persistent == ({True} if threshold >= 10_000 else {False} if threshold == 0 else {True, False})
    assert all(r["released"] for r in results)
    if world > 1:  # a rank's shard of a unit holds pieces of several parameters
        assert any(n > 1 for r in results for _, n in r["units"])


def test_save_16bit_model_excludes_frozen(tmp_path) -> None:
    results = run_distributed(2, save_stage0_and_stage3, str(tmp_path), None, 0, True)
    ref = torch.load(tmp_path / "stage0" / "pytorch_model.bin", weights_only=True)
    saved = torch.load(tmp_path / "stage3" / "pytorch_model.bin", weights_only=True)
    want = [k for k in results[0]["stage0"] if k not in FROZEN]
    assert list(ref) == want and list(saved) == want and list(results[0]["state"]) == want
    for name in want:  # trained at stage 3 vs stage 0: [Note: bit equality across stages]
        torch.testing.assert_close(saved[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)


# --- one unit at a time ----------------------------------------------------------------------
def gather_one_unit_at_a_time(save_dir: str, exclude_frozen: bool) -> dict:
    """Wraps ShardedUnit.gather_full to record, at each call, which unit is gathered and the
    bytes of earlier calls' results still alive (weak references)."""
    from deepspeed.runtime.zero.stage3.sharded_param import ShardedUnit

    engine = _train(3, None, {"stage3_gather_16bit_weights_on_model_save": True})
    calls: list[dict] = []
    alive: list[weakref.ref] = []
    original = ShardedUnit.gather_full

    def counting(unit: ShardedUnit, shard: torch.Tensor) -> list[torch.Tensor]:
        live = sum(t.numel() * t.element_size() for t in (ref() for ref in alive) if t is not None)
        calls.append({"unit": unit.spec.index, "live_before": live, "shard_is_params": shard is unit.shard,
                      "gathered_units": sum(u.available and not u.spec.persistent for u in engine._stage3.units)})
        tensors = original(unit, shard)
        alive.extend(weakref.ref(t) for t in tensors)
        return tensors

    ShardedUnit.gather_full = counting
    try:
        assert engine.save_16bit_model(save_dir, exclude_frozen_parameters=exclude_frozen)
    finally:
        ShardedUnit.gather_full = original
    units = engine._stage3.units
    wanted = [u.spec.index for u in units if not exclude_frozen or any(p.requires_grad for p in u.params)]
    unit_bytes = {u.spec.index: u.spec.numel * u.shard.element_size() for u in units}
    kept = {u.spec.index: sum(n for p, n in zip(u.params, u.spec.numels) if p.requires_grad or not exclude_frozen)
            * u.shard.element_size() for u in units}
    return {"calls": calls, "wanted": wanted, "unit_bytes": unit_bytes, "kept": kept,
            "live_after": sum(t.numel() * t.element_size() for t in (r() for r in alive) if t is not None)}


@pytest.mark.parametrize("world,exclude_frozen", [(2, False), (4, True)])
def test_save_gathers_one_unit_at_a_time(tmp_path, world: int, exclude_frozen: bool) -> None:
    results = run_distributed(world, gather_one_unit_at_a_time, str(tmp_path), exclude_frozen)
    for rank, r in enumerate(results):
        assert len(r["wanted"]) >= 4
        assert [c["unit"] for c in r["calls"]] == r["wanted"]  # each wanted unit once, in unit order
        assert all(c["shard_is_params"] and c["gathered_units"] == 0 for c in r["calls"])
        if rank == 0:  # rank 0 keeps (a CPU copy of) the wanted tensors of earlier units, nothing else
            for k, c in enumerate(r["calls"]):
                assert c["live_before"] <= sum(r["kept"][u] for u in r["wanted"][:k]), (k, c)
        else:  # the others drop each unit before gathering the next
            assert all(c["live_before"] == 0 for c in r["calls"]), r["calls"]
            assert r["live_after"] == 0
    if exclude_frozen:  # the wholly frozen unit is not gathered at all
        assert len(results[0]["wanted"]) == len(results[0]["unit_bytes"]) - 1


# --- flag off, one rank only -------------------------------------------------------------------
def save_with_flag_off(save_dir: str) -> dict:
    from deepspeed.utils.logging import logger

    engine = _train(3, None, {})
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        saved = engine.save_16bit_model(save_dir)
    finally:
        logger.removeHandler(handler)
    state = engine._zero3_consolidated_16bit_state_dict()  # gathers whatever the flag says (upstream)
    return {"saved": saved, "flag": engine.zero_gather_16bit_weights_on_model_save(),
            "warnings": [r.getMessage() for r in records], "state": state}


def test_save_16bit_model_flag_off_writes_nothing(tmp_path) -> None:
    results = run_distributed(2, save_with_flag_off, str(tmp_path / "out"))
    assert [r["saved"] for r in results] == [False, False]
    assert [r["flag"] for r in results] == [False, False]
    assert not (tmp_path / "out").exists()
    (warning,) = results[0]["warnings"]
    assert "stage3_gather_16bit_weights_on_model_save" in warning and "zero_to_fp32" in warning
    assert "save_checkpoint" in warning
    assert results[1]["warnings"] == []
    state = results[0]["state"]
    assert state["fc1.weight"].shape == (13, 7) and list(state) == list(SaveNet().state_dict())
    assert results[1]["state"] is None


def save_on_rank0_only_at_stage3(save_dir: str) -> str:
    return save_on_rank0_only(save_dir, _train(3, None, {"stage3_gather_16bit_weights_on_model_save": True}))


def test_save_16bit_model_on_one_rank_fails_instead_of_hanging(tmp_path) -> None:
    assert_one_rank_save_failed(run_distributed(2, save_on_rank0_only_at_stage3, str(tmp_path), timeout=60), tmp_path)
