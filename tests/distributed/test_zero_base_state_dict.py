"""The base optimizer's own state_dict() at ZeRO-1/2 has DeepSpeed's shape: one flat per param group, the
same size on every rank ([Note: the base optimizer's state_dict at ZeRO-1/2] in zero/shard_state_dict.py).

Upstream's universal-checkpoint tests all-gather `engine.optimizer.optimizer.state_dict()`'s tensors; ours
held one tensor per parameter fragment, a different number on each rank, and gloo aborted. On 4 gloo ranks:
the per-group flats gather; a one-bucket group gathers to its full states in bucket order; a state_dict
with exp_avg doubled loads back through load_state_dict into the fragments (and training goes on); a
state_dict taken at another world size is refused with a clear error.
"""

from __future__ import annotations

import math

import ckpt_desc_jobs as D
import ckpt_jobs as J
from harness import run_distributed


def _check_round_trip(out: dict, groups: int) -> None:
    assert out["mark"] is True
    assert out["keys"] == list(range(groups)) and out["params"] == [[g] for g in range(groups)]
    assert out["doubled"], "exp_avg doubled in the flats did not reach the fragments (or other state moved)"
    assert out["raw_form_back"]
    assert all(math.isfinite(x) for x in out["losses"])


def test_one_group_gathers_to_full_states_zero1():
    outs = run_distributed(4, D.base_state_job, J.config(1, 4), False)
    for out in outs:
        _check_round_trip(out, 1)
        assert out["one_bucket"] and out["gathered_is_full"]


def test_two_groups_many_buckets_zero2_and_another_world_size(tmp_path):
    cfg = J.config(2, 4)
    cfg["zero_optimization"]["reduce_bucket_size"] = 64   # several buckets, groups mixed in them
    saved = str(tmp_path / "base_sd.pt")
    for out in run_distributed(4, D.base_state_job, cfg, True, saved):
        _check_round_trip(out, 2)
    cfg2 = J.config(2, 2)
    cfg2["zero_optimization"]["reduce_bucket_size"] = 64
    for out in run_distributed(2, D.base_state_job, cfg2, True, None, saved):
        assert "another world size" in out["error"] and "engine.load_checkpoint" in out["error"], out
