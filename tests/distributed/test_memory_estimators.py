"""The ZeRO memory estimators (`deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_*`,
`deepspeed.runtime.zero.stage3.estimate_zero3_*`): upstream's names, arguments and table, and
numbers that are this runtime's, checked by counting the bytes a real engine holds per rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_distributed

WIDTH, LAYERS = 192, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def test_upstream_import_paths_and_table(capsys) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_live)

    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64))
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=1)
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert "HW: Setup with 1 node, 2 GPUs per node." in out
    assert "SW: Model with 0M total params, 0M largest layer params." in out
    zero3_rows = [line for line in out.splitlines() if "offload_param=" in line]
    assert len(zero3_rows) == 6 and "offload_param=cpu, offload_optimizer=none" not in out
    assert sum("offload_optimizer=" in line and "offload_param" not in line for line in out.splitlines()) == 2
    cpu, gpu = estimate_zero2_model_states_mem_needs(10 ** 6, num_gpus_per_node=4, cpu_offload=False,
                                                     additional_buffer_factor=1.0)
    assert (cpu, gpu) == (16 * 10 ** 6, 2 * 10 ** 6 + 4 * 10 ** 6)
    with pytest.raises(ValueError, match="num_gpus_per_node must be a positive integer, got 0"):
        estimate_zero2_model_states_mem_needs(10, num_gpus_per_node=0)


def _counted(stage: int, offload_optimizer: bool) -> dict:
    """Bytes of model state this rank holds, by device, between a backward and the step (the peak:
    gradient shards and optimizer state both exist), counted over unique storages."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum, state_slots

    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    x = torch.randn(2, WIDTH, dtype=torch.bfloat16)
    for _ in range(2):   # the first step creates the optimizer state; the second backward the shards
        engine.backward(engine(x).float().square().mean())
        if not engine.optimizer.optimizer.state:
            engine.step()
    storages: dict[int, int] = {}
    for kind in OffloadStateTypeEnum:
        for slot in state_slots(engine, kind):
            t = slot.get()
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for p in engine.module.parameters():   # parameters not in any slot would be missed state
        if p.numel():
            assert p.untyped_storage().data_ptr() in storages
    total = sum(storages.values())
    engine.destroy()
    return {"bytes": total, "world": dist.get_world_size()}


@pytest.mark.parametrize("stage", [2, 3])
def test_estimate_matches_the_bytes_an_engine_holds(stage: int) -> None:
    """With no offload everything is on the compute device (the CPU here): the per-GPU estimate
    minus the gathered largest layer (ZeRO-3's L, transient) is what a rank holds, up to padding."""
    from deepspeed.runtime.zero.memory_estimators import (estimate_zero2_model_states_mem_needs,
                                                          estimate_zero3_model_states_mem_needs)

    world = 2
    psi = LAYERS * (WIDTH * WIDTH + WIDTH)
    if stage == 2:
        _, estimate = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=world, cpu_offload=False)
    else:
        _, gpu, largest = estimate_zero3_model_states_mem_needs(psi, WIDTH * WIDTH + WIDTH, num_gpus_per_node=world,
                                                                cpu_offload=False, cpu_offload_params=False)
        estimate = gpu - largest
    counted = run_distributed(world, _counted, stage, False)
    for rank in counted:
        # padding: at most world-1 elements per bucket/unit, in each of the per-shard tensors
        assert abs(rank["bytes"] - estimate) <= 0.01 * estimate, (rank["bytes"], estimate)
