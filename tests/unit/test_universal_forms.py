"""DeepSpeed 0.19.8's universal files for AutoEP, read here (docs/checkpointing.md "With DeepSpeed 0.19.8"):
the ZeRO-3 form (dense parameters as bare flat tensors, no step.pt, the step in rank 0's optimizer state, per-rank
model states), optimizer groups split per expert group as its engine splits them, and the form ours writes."""

from __future__ import annotations

import os

import torch

from deepspeed.checkpoint.moe_to_universal import common_state
from deepspeed.checkpoint.reader import CheckpointReader
from deepspeed.runtime.checkpoint.moe_io import source_param_groups


def _deepspeed_zero3_universal(root: str) -> None:
    tag = os.path.join(root, "t_universal")
    os.makedirs(os.path.join(tag, "zero", "w"))
    os.makedirs(os.path.join(tag, "zero", "experts.w1"))
    torch.save({"module": {}, "param_shapes": [{"w": (2, 3)}, {"experts.w1": (1, 2, 2)}]},
               os.path.join(tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    torch.save(torch.arange(6.0), os.path.join(tag, "zero", "w", "fp32.pt"))   # bare and flat, as its ZeRO-3 writes
    torch.save(torch.ones(6), os.path.join(tag, "zero", "w", "exp_avg.pt"))
    torch.save({"param": torch.zeros(2, 2, 2), "cat_dim": 0, "is_expert_param": True, "ep_num_experts": 2},
               os.path.join(tag, "zero", "experts.w1", "fp32.pt"))
    torch.save({"param_groups": [{"lr": 0.1, "name": "dense-params", "params": [0]},
                                 {"lr": 0.1, "name": "ep_size_2", "moe": True, "params": [1]}],
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": []}},
               os.path.join(tag, "zero", "optimizer_state.pt"))


def test_deepspeed_zero3_universal_form_reads_whole(tmp_path) -> None:
    _deepspeed_zero3_universal(str(tmp_path))
    reader = CheckpointReader(str(tmp_path), "t_universal")
    shapes = {n: tuple(s) for g in reader.groups() for n, s in g}
    assert shapes == {"w": (2, 3), "experts.w1": (2, 2, 2)}   # dense by param_shapes; experts whole (not local)
    assert torch.equal(reader.read("w", "fp32").view(2, 3), torch.arange(6.0).view(2, 3))
    assert reader.step == 7.0
    assert source_param_groups(reader.param_groups, 1) == [{"lr": 0.1, "name": "dense-params"}]
    assert source_param_groups(reader.param_groups, 2) == reader.param_groups   # already this engine's groups


def test_autoep_common_state_is_split_as_deepspeeds_engine_splits() -> None:
    states = {"ds_autoep_layers": [{"ep_size": 2}], "ds_version": "0.19.8+pure.1"}
    common = common_state([{"lr": 0.1}, {"lr": 0.2}], {"cur_scale": 1.0, "cur_iter": 3, "dynamic_loss_scale": False},
                          states)
    assert [(g["name"], g.get("moe", False), g["lr"], g["params"]) for g in common["param_groups"]] == [
        ("dense-params", False, 0.1, [0]), ("dense-params", False, 0.2, [1]), ("ep_size_2", True, 0.1, [2]),
        ("ep_size_2", True, 0.2, [3])]
    assert common["ds_version"] == "0.19.8+pure.1" and common["dynamic_loss_scale"] is False
    assert not isinstance(common["loss_scaler"], dict) and common["loss_scaler"].cur_iter == 3   # the object
    assert [g["lr"] for g in source_param_groups(common["param_groups"], 2)] == [0.1, 0.2]
