"""DeepSpeed 0.19.8's ZeRO-1 AutoEP checkpoint (its per-expert files keyed `experts.w1.<E>` and flat optimizer
partitions: dense groups over the data-parallel ranks, expert groups over the expert-data-parallel ranks;
[Note: DeepSpeed's ZeRO-1/2 AutoEP optimizer files]) loads here with a plain strict load_checkpoint, at the
autoep_size that saved it and at another, with DeepSpeed's own values."""

from __future__ import annotations

import os

import pytest
import torch

from autoep_ds_zero1_jobs import FIXTURES, load_run
from harness import run_distributed


@pytest.mark.parametrize("ep", [2, 1])
def test_deepspeed_autoep_zero1_checkpoint_loads_at_any_autoep_size(ep: int) -> None:
    expected = torch.load(os.path.join(FIXTURES, "ds_0_19_8_autoep_zero1", "expected.pt"), weights_only=False)
    for r in run_distributed(2, load_run, ep):
        assert r["steps"] == [expected["step"]] == [2.0]
        for key in ("whole", "exp_avg", "exp_avg_sq"):
            assert sorted(r[key]) == sorted(expected[key])
            for name, value in expected[key].items():
                assert torch.equal(r[key][name], value), (key, name)
