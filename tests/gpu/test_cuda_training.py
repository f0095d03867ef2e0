"""The engine on one CUDA device (world size 1): bf16 at ZeRO 0-3 against plain PyTorch, optimizer
offload and parameter offload to (pinned) CPU memory, activation checkpointing with dropout."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import assert_matches_reference, batches, config, engine_for, masters, reference, train

STEPS = 3


def _state_tensors(engine, kind_name: str) -> list[torch.Tensor]:
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum, state_slots

    return [t for s in state_slots(engine, OffloadStateTypeEnum[kind_name]) if (t := s.get()) is not None]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_stage_matches_plain_pytorch(device, stage):
    data = batches(STEPS, device)
    engine = engine_for(config(stage))
    assert engine.device.type == device.type
    assert engine.module.norm.weight.dtype == torch.bfloat16
    losses = train(engine, data)
    assert_matches_reference(losses, masters(engine), *reference(data, device))
    if device.type == "cuda":
        assert torch.cuda.max_memory_allocated() > 0
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_keeps_masters_on_cpu_and_matches(device, stage):
    data = batches(STEPS, device)
    engine = engine_for(config(stage, offload_optimizer={"device": "cpu", "pin_memory": True}))
    losses = train(engine, data)
    assert_matches_reference(losses, masters(engine), *reference(data, device))
    assert {t.device.type for t in _state_tensors(engine, "hp_params")} == {"cpu"}
    assert {t.device.type for t in _state_tensors(engine, "optim_states")} == {"cpu"}
    if stage < 3:   # the bf16 parameters stay on the device
        assert {t.device.type for t in _state_tensors(engine, "lp_params")} == {device.type}
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("pin", [True, False])
def test_offload_optimizer_pin_memory_pins_masters(device, stage, pin):
    """[Note: pinned optimizer offload]: masters and their gradient copies page-locked, the
    gradient copies asynchronous (one wait per step); the same numbers as without pinning. On the
    CPU (DS_GPU_TESTS_ON_CPU=1) nothing is pinned, whatever the flag."""
    want = pin and device.type == "cuda"
    data = batches(STEPS, device)
    engine = engine_for(config(stage, offload_optimizer={"device": "cpu", "pin_memory": pin}))
    losses = train(engine, data)
    assert_matches_reference(losses, masters(engine), *reference(data, device))
    shards = list(getattr(engine.optimizer, "units", None) or engine.optimizer.buckets)
    assert shards and all(s.pinned == want for s in shards)
    assert all(t.is_pinned() == want for t in _state_tensors(engine, "hp_params"))
    if device.type == "cuda":   # on the CPU an fp32 shard needs no gradient copy
        assert all(s.master_grad_copy is not None and s.master_grad_copy.is_pinned() == want for s in shards)
    engine.destroy()


def test_offload_param_keeps_pinned_shards_on_cpu_and_matches(device):
    data = batches(STEPS, device)
    cfg = config(3, offload_param={"device": "cpu", "pin_memory": True},
                 offload_optimizer={"device": "cpu", "pin_memory": True})
    engine = engine_for(cfg)
    losses = train(engine, data)
    assert_matches_reference(losses, masters(engine), *reference(data, device))
    shards = _state_tensors(engine, "lp_params")
    assert shards and {t.device.type for t in shards} == {"cpu"}
    # between steps no parameter is gathered on the device (each is an empty placeholder)
    assert all(p.data.numel() == 0 and p.device.type == device.type for p in engine.module.parameters())
    if device.type == "cuda":
        assert all(t.is_pinned() for t in shards)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_replays_device_dropout(device, stage):
    """Checkpointed blocks with dropout recompute in backward under the replayed device RNG state:
    the same kernels on the same tensors, so the run equals an uncheckpointed one bit for bit."""
    data = batches(STEPS, device)
    runs = []
    for checkpoint in (False, True):
        engine = engine_for(config(stage), dropout=0.2, checkpoint=checkpoint)
        torch.manual_seed(7)
        if device.type == "cuda":
            torch.cuda.manual_seed(7)
        runs.append((train(engine, data), masters(engine)))
        engine.destroy()
    (plain_losses, plain_w), (ckpt_losses, ckpt_w) = runs
    assert plain_losses == ckpt_losses
    for a, b in zip(plain_w, ckpt_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
