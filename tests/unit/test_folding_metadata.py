"""The EP x TP checkpoint record ([Note: folding metadata] in deepspeed/checkpoint/autoep_universal.py) and the
per-expert file consolidation: pure functions, no ranks."""

from __future__ import annotations

import os

import pytest
import torch

from deepspeed.checkpoint.autoep_universal import (consolidate_autoep_expert_files, make_folding_metadata,
                                                   validate_folding_metadata)
from deepspeed.checkpoint.constants import FOLDING_METADATA_KEY, PARAM


def _record(**overrides):
    base = dict(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0, zero_partition_group="edp", zero_partition_rank=0,
                zero_partition_count=2, family="routed_expert")
    return {FOLDING_METADATA_KEY: make_folding_metadata(**{**base, **overrides})}


def test_validate_checks_sizes_and_each_given_key() -> None:
    state = _record()
    assert validate_folding_metadata(state, tp_size=2, ep_size=2, tp_rank=1, family="routed_expert")["etp_size"] == 1
    for kwargs, key in (({"tp_size": 4, "ep_size": 2}, "tp_size"), ({"tp_size": 2, "ep_size": 4}, "ep_size"),
                        ({"tp_size": 2, "ep_size": 2, "tp_rank": 0}, "tp_rank"),
                        ({"tp_size": 2, "ep_size": 2, "family": "dense"}, "family")):
        with pytest.raises(RuntimeError, match=f"mismatch for {key}: saved="):
            validate_folding_metadata(state, **kwargs)
    with pytest.raises(RuntimeError, match="Missing AutoEP\\+AutoTP folding metadata"):
        validate_folding_metadata({"module": {}}, tp_size=2, ep_size=2)
    with pytest.raises(TypeError, match="unknown keys \\['tp_rnk'\\]"):
        validate_folding_metadata(state, tp_size=2, ep_size=2, tp_rnk=0)


def test_consolidate_stacks_experts_and_refuses_tensor_shards(tmp_path) -> None:
    for e in range(3):
        torch.save({f"m.experts.{w}.{e}": torch.full((2, 2), float(e)) for w in ("w1", "w2", "w3")},
                   tmp_path / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    meta = [{"moe_layer_id": 0, "num_experts": 3, "expert_key_prefix": "m.experts"}]
    consolidate_autoep_expert_files(str(tmp_path), str(tmp_path / "out"), meta)
    whole = torch.load(tmp_path / "out" / "zero" / "m.experts.w2" / "fp32.pt")[PARAM]
    assert torch.equal(whole, torch.arange(3.0).view(3, 1, 1).expand(3, 2, 2))
    torch.save({**_record(tp_rank=1), "m.experts.w1.0": torch.ones(2, 2)},
               tmp_path / "layer_0_expert_0_mp_rank_01_model_states.pt")   # a second tensor rank's copy of expert 0
    with pytest.raises(NotImplementedError, match="folded AutoEP\\+AutoTP expert shards"):
        consolidate_autoep_expert_files(str(tmp_path), str(tmp_path / "out2"), meta)
    assert not os.path.exists(tmp_path / "out2")
