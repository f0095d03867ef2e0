"""engine.save_16bit_model / _zero3_consolidated_16bit_state_dict at ZeRO stages 0-2."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness import run_distributed
from models import make_model
from test_engine_dp import _config


class TiedFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.proj.bias.requires_grad_(False)  # frozen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.out(torch.tanh(self.proj(self.embed(x)))), y)


def save_after_step(save_dir: str, config: dict, tied: bool, exclude_frozen: bool) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    torch.manual_seed(0)
    model = TiedFrozen() if tied else make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=copy.deepcopy(config))
    g = torch.Generator().manual_seed(dist.get_rank())
    if tied:
        x, y = torch.randint(0, 10, (4,), generator=g), torch.randint(0, 10, (4,), generator=g)
    else:
        x, y = torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    dtype = next(engine.module.parameters()).dtype
    loss = engine(x.to(dtype) if x.is_floating_point() else x, y)
    engine.backward(loss)
    engine.step()
    assert engine.save_16bit_model(save_dir, exclude_frozen_parameters=exclude_frozen)
    assert engine.save_16bit_model(save_dir, "model.safetensors", exclude_frozen_parameters=exclude_frozen)
    state = engine._zero3_consolidated_16bit_state_dict()
    return {"state": state, "live": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}


@pytest.mark.parametrize("stage,precision", [(0, None), (1, "bf16"), (2, "fp16"), (2, None)])
def test_save_16bit_model_writes_the_live_weights(tmp_path, stage, precision) -> None:
    extra = {precision: {"enabled": True}} if precision else {}
    config = _config(micro=4, zero_optimization={"stage": stage, "reduce_bucket_size": 500}, **extra)
    results = run_distributed(2, save_after_step, str(tmp_path), config, False, False)
    assert results[1]["state"] is None
    live = results[0]["live"]
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    from safetensors.torch import load_file

    saved_st = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(live) == set(saved_st) == set(results[0]["state"])
    want = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for name, value in live.items():
        assert torch.equal(saved[name], value) and torch.equal(saved_st[name], value), name
        if value.is_floating_point():
            assert saved[name].dtype == want, name


def test_save_16bit_model_tied_and_frozen(tmp_path) -> None:
    config = _config(micro=4, zero_optimization={"stage": 2, "reduce_bucket_size": 50})
    results = run_distributed(2, save_after_step, str(tmp_path), config, True, True)
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert "proj.bias" not in saved  # frozen, excluded
    assert torch.equal(saved["out.weight"], saved["embed.weight"])  # tied: both names, same values
    assert torch.equal(saved["embed.weight"], results[0]["live"]["embed.weight"])


def save_on_rank0_only(save_dir: str, engine: object = None) -> str:
    """Rank 0 alone calls save_16bit_model; returns the error it got."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm import rendezvous

    if engine is None:
        engine, *_ = deepspeed.initialize(model=make_model(), config=_config(micro=2, zero_optimization={"stage": 1}))
    rendezvous.DEFAULT_TIMEOUT_S, before = 2.0, rendezvous.DEFAULT_TIMEOUT_S
    try:
        if dist.get_rank() == 0:
            try:
                engine.save_16bit_model(save_dir)
            except rendezvous.RanksDidNotArrive as error:
                return str(error)
            return "no error"
        next(rendezvous._calls)  # keep this worker's arrival count in step with rank 0's for later tests
        return "skipped"
    finally:
        rendezvous.DEFAULT_TIMEOUT_S = before


def assert_one_rank_save_failed(results: list[str], save_dir) -> None:
    assert "ranks [1] of 2 did not call it" in results[0] and "all ranks must call save_16bit_model" in results[0]
    assert not (save_dir / "pytorch_model.bin").exists()


def test_save_16bit_model_on_one_rank_fails_instead_of_hanging(tmp_path) -> None:
    assert_one_rank_save_failed(run_distributed(2, save_on_rank0_only, str(tmp_path), timeout=60), tmp_path)
