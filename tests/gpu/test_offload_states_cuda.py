"""engine.offload_states() / reload_states() on a CUDA device (skipped without one): the state
really leaves the device (allocated bytes drop by at least what moved), lands pinned on the CPU,
comes back to the device, and training goes on exactly as without the round trip. The CPU-only
checks of the same logic (every alias rebound, bit-equal round trips over 2 ranks) are in
tests/distributed/test_offload_states.py. Written without a GPU at hand (none was lent to the
session that wrote it): run it where one is."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(stage: int, seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def _train_step(engine, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 256, generator=gen).to(engine.device, torch.bfloat16)
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_leaves_the_device_and_comes_back(stage: int) -> None:
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum, get_state_devices, state_slots

    engine = _engine(stage)
    reference = _engine(stage)
    losses = [_train_step(engine, 0)]
    expected = [_train_step(reference, 0)]
    torch.cuda.synchronize()
    moved = sum(t.untyped_storage().nbytes() for kind in OffloadStateTypeEnum for s in state_slots(engine, kind)
                if (t := s.get()) is not None and t.is_cuda)
    before = torch.cuda.memory_allocated()
    engine.offload_states(pin_memory=True)
    torch.cuda.synchronize()
    assert before - torch.cuda.memory_allocated() >= moved * 0.99
    for kind in OffloadStateTypeEnum:
        assert get_state_devices(engine, kind) <= {torch.device("cpu")}, kind
    for slot in state_slots(engine, OffloadStateTypeEnum.hp_params):   # moved from the device: pinned
        assert slot.get().is_pinned()
    if stage == 3:   # a ZeRO-3 forward gathers from the offloaded shards
        with torch.no_grad():
            engine(torch.zeros(4, 256, device=engine.device, dtype=torch.bfloat16))
    engine.reload_states()
    torch.cuda.synchronize()
    for kind in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_params):   # (Adam's step counts may live on the CPU)
        assert {d.type for d in get_state_devices(engine, kind)} == {"cuda"}, kind
    losses.append(_train_step(engine, 1))
    expected.append(_train_step(reference, 1))
    assert losses == expected
    engine.destroy()
    reference.destroy()
