"""deepspeed.checkpoint's inspection API (DeepSpeedCheckpoint, ZeROCheckpoint, model_3d_desc,
get_model_3d_descriptor): the layout of a checkpoint folder and which source files each rank of a
smaller layout reads. Pure: small folders written here, plus a DeepSpeed 0.19.8-written fixture."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from deepspeed.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc
from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
from deepspeed.runtime.checkpoint.parallel_dims import recorded_parallel_dims
from deepspeed.runtime.engine import _checkpoint_parallel_metadata

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8", "stage2_fp32", "global_step3")


def _folder(path, pp, tp, dp, record=True, iteration=7):
    """A checkpoint tag folder of pp*tp model-states files and dp*pp*tp bf16 ZeRO files."""
    for mp in range(pp * tp):
        state = {"param_shapes": [{f"w{mp}": torch.Size([2, 2])}], "ds_config": {}, "iteration": iteration,
                 UNIVERSAL_CHECKPOINT_INFO: {"mp": mp},
                 "ds_autoep_layers": [{"expert_key_prefix": "m.experts", "num_experts": 4, "ep_size": 2,
                                       "num_local_experts": 2, "moe_layer_id": 0, "extra": mp}]}
        if record:
            state[CHECKPOINT_PARALLEL_DIMS] = {"pp_degree": pp, "tp_degree": tp}
        torch.save(state, os.path.join(path, f"mp_rank_{mp:02d}_model_states.pt"))
        for dp_rank in range(dp):
            torch.save({}, os.path.join(path, f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt"))
    return str(path)


def test_a_3d_checkpoint_reports_its_layout_and_each_target_ranks_files(tmp_path):
    ckpt = DeepSpeedCheckpoint(_folder(tmp_path, pp=2, tp=2, dp=2))
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree, ckpt.original_world_size) == (2, 2, 2, 8)
    assert [os.path.basename(p) for p in ckpt.mp_rank_files] == [f"mp_rank_0{i}_model_states.pt" for i in range(4)]
    assert ckpt.get_iteration() == 7 and ckpt.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) == {"mp": 0}
    # ZeRO files are (dp, mp)-ordered: file index dp * 4 + mp
    assert [os.path.basename(p) for p in ckpt.get_zero_files(pp_index=1, tp_index=0, dp_index=1)] == \
        ["bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt"]
    shapes, layers, ordering = _aggregate_autoep_zero12_metadata(ckpt.model_state_metadata)
    assert shapes[3] == {"w3": torch.Size([2, 2])} and ordering is False
    assert layers == [{"expert_key_prefix": "m.experts", "num_experts": 4, "ep_size": 2, "num_local_experts": 2,
                       "moe_layer_id": 0}]   # only the fields conversion needs are kept

    smaller = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1, pp_degree=1, dp_degree=1)
    assert smaller.get_2d_parallel_files(tp_index=0, pp_index=0) == ckpt.mp_rank_files
    assert smaller.zero_checkpoint.get_file_indices_for_rank(0, 0, 0) == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("target,expected", [
    ((1, 1, 1), [{(0, 0): [0, 4, 1, 5, 2, 6, 3, 7]}]),
    ((1, 2, 1), [{(0, 0): [0, 4, 2, 6], (0, 1): [1, 5, 3, 7]}]),
    ((2, 1, 2), [{(0, 0): [0, 4], (1, 0): [2, 6]}, {(0, 0): [1, 5], (1, 0): [3, 7]}]),
])
def test_reshape_maps_of_a_2x2x2_layout(target, expected):
    maps = model_3d_desc(2, 2, 2).reshape(model_3d_desc(*target))
    assert [{(p, t): m.get_data(p, t) for p in range(m.pp_degree) for t in range(m.tp_degree)} for m in maps] == \
        expected


def test_reshape_refuses_expansion_and_uneven_folds():
    ok, errors = model_3d_desc(2, 3, 2).can_reshape(model_3d_desc(4, 2, 2))
    assert not ok and errors == ["Expansion reshape not supported - PP: 2 ---> 4",
                                 "Reshape TP: 3 ---> 2 needs a degree that divides 3"]
    with pytest.raises(ValueError, match="Expansion reshape not supported - PP: 2 ---> 4"):
        model_3d_desc(2, 3, 2).reshape(model_3d_desc(4, 2, 2))


def test_descriptor_of_legacy_and_bad_records(tmp_path):
    legacy = get_model_3d_descriptor(_folder(tmp_path, pp=1, tp=2, dp=3, record=False))
    assert (legacy.pp_degree, legacy.tp_degree, legacy.dp_degree) == (1, 2, 3)
    torch.save({CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 0, "tp_degree": 2}},
               os.path.join(tmp_path, "mp_rank_00_model_states.pt"))
    with pytest.raises(RuntimeError, match="pp_degree must be a positive integer .*mp_rank_00.*got 0"):
        ZeROCheckpoint(str(tmp_path))


def test_a_deepspeed_0_19_8_checkpoint():
    ckpt = DeepSpeedCheckpoint(FIXTURE)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (1, 1, 2)
    assert ckpt.model_state_metadata[0][1][CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 1, "tp_degree": 1}


def test_the_record_our_writer_adds():
    grid = SimpleNamespace(get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 2)
    assert recorded_parallel_dims(None, grid, 4) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 2, "tp_degree": 2}}
    assert recorded_parallel_dims(None, None, 2) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 2}}
    alst = SimpleNamespace(initialize_sequence_parallel=None, get_model_parallel_world_size=lambda: 4)
    assert recorded_parallel_dims(alst, None, 1) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 1}}
    megatron = SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2,
                               get_pipeline_model_parallel_world_size=lambda: 3)
    assert _checkpoint_parallel_metadata(megatron) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 3, "tp_degree": 2}}
    assert recorded_parallel_dims(megatron, None, 2) == {}   # would not match the 2 mp_rank files: left out
