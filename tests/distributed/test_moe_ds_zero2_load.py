"""DeepSpeed 0.19.8's own `deepspeed.moe` ZeRO-2 checkpoint (tests/fixtures/ds_0_19_8_moe_zero2: its MoE layer,
ep=2 on 2 ranks, Adam; one flat partition per optimizer group, the dense group over the 2 data-parallel
ranks, the expert group over each EP rank's expert-data-parallel group of 1: [Note: DeepSpeed's ZeRO-1/2
AutoEP optimizer files]) loads with a plain strict load_checkpoint at ep=2 and ep=1: parameters, both Adam
moments and the step equal DeepSpeed's own values (its generator reads the moments from its flats)."""

from __future__ import annotations

import os

import pytest
import torch

from harness import run_distributed
from moe_jobs import load_deepspeed_fixture

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_moe_zero2")


@pytest.mark.parametrize("ep", [2, 1])
def test_deepspeed_moe_zero2_checkpoint_loads_at_any_ep_size(ep: int) -> None:
    step = torch.load(os.path.join(FIXTURE, "expected_rank0.pt"))["step"]
    for r in run_distributed(2, load_deepspeed_fixture, FIXTURE, ep, stage=2):
        assert r["steps"] == 2 and r["step"] == [step] == [2.0]
        assert len(r["state"]) == 6 + 2 * 2 * 4 // ep   # dense + (layers x experts held x weight, bias)
        got = {**r["state"], **r["exp_avg"], **r["exp_avg_sq"]}
        assert r["exp_avg_sq_expected"] == {} and set(got) == set(r["expected"])
        for name, value in r["expected"].items():
            assert torch.equal(got[name], value), name
