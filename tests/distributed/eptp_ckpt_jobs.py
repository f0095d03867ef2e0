"""Jobs for EP x TP checkpoints: save, resume at the same layout, zero_to_fp32 (test_ep_tp_checkpoint.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from autoep_jobs import MICRO, batch
from eptp_jobs import MPU, MoENet, _model, _moe_data, _moe_state


def _whole_autoep(engine: Any) -> dict:
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with GatherReplacedLayerParams(list(engine.module.parameters()), engine.module, enabled=True):
        return {k: v.clone() for k, v in engine.module.state_dict().items()}   # experts: gathered over EP


def _consolidated(save_dir: str, tag: str) -> dict:
    """zero_to_fp32 on rank 0 (standalone module: what the script copied next to the checkpoint runs)."""
    import deepspeed.comm as dist

    out = {}
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out = dict(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag))
    dist.barrier()
    return out


def autoep_autotp_checkpoint(kind: str, save_dir: str, stage: int, steps: int, tp: int = 2, ep: int = 2) -> dict:
    """Adam, `steps` steps, save, `steps` more; a fresh engine loads and trains the same `steps`: both runs'
    losses and whole weights, the whole weights at the save and zero_to_fp32's state dict of the checkpoint."""
    import deepspeed

    def engine_at() -> Any:
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
                  "zero_optimization": {"stage": stage}, "gradient_clipping": 0.5,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "tensor_parallel": {"autotp_size": tp},
                  "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": kind}}
        return deepspeed.initialize(model=_model(kind), config=config)[0]

    def train(engine: Any, first: int) -> list:
        losses = []
        for step in range(first, first + steps):
            ids = batch(step, engine.get_data_parallel_rank())
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine = engine_at()
    train(engine, 0)
    engine.save_checkpoint(save_dir, tag="t")
    at_save = _whole_autoep(engine)
    consolidated = _consolidated(save_dir, "t")
    straight = train(engine, steps)
    whole = _whole_autoep(engine)
    resumed = engine_at()
    resumed.load_checkpoint(save_dir, tag="t")
    again = train(resumed, steps)
    return {"straight": straight, "resumed": again, "whole": whole, "whole_resumed": _whole_autoep(resumed),
            "at_save": at_save, "consolidated": consolidated, "files": sorted(os.listdir(os.path.join(save_dir, "t")))}
