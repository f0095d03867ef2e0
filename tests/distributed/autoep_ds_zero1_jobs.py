"""Jobs of test_autoep_ds_zero1_load.py: DeepSpeed 0.19.8's ZeRO-1 AutoEP checkpoint
(tests/fixtures/ds_0_19_8_autoep_zero1) loaded here by a plain, strict load_checkpoint."""

from __future__ import annotations

import os
import sys

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")


def load_run(ep: int) -> dict:
    """The fixture loaded at autoep_size `ep` (ZeRO-1, 2 ranks): each parameter's whole fp32 master and Adam
    moments (an expert tensor's rows gathered over its EP group) and the optimizer steps."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    sys.path.insert(0, os.path.join(FIXTURES, "ds_0_19_8_autoep_zero3"))
    import autoep_model

    config = dict(autoep_model.config(ep), zero_optimization={"stage": 1})
    engine, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
    engine.load_checkpoint(os.path.join(FIXTURES, "ds_0_19_8_autoep_zero1", "ckpt"), tag="t")   # strict defaults

    def whole(name: str, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().float().cpu().contiguous()
        if ".experts.w" in name and ep > 1:   # this EP rank's rows (ep = world size here)
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, value)
            value = torch.cat(parts)
        return value

    named = list(engine.module.named_parameters())
    out = {"whole": {n: whole(n, safe_get_full_fp32_param(p)) for n, p in named},
           "steps": sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values()})}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: whole(n, safe_get_full_optimizer_state(p, key)) for n, p in named}
    return out
