"""Tensor-parallel checkpoints that describe their slices only by DeepSpeed's pattern lists
(`universal_checkpoint_info` without affine maps), converted by our `ds_to_universal` (tp_maps.pattern_layout
and split_map: the one rule our converter, TP re-slice and upstream-named adapters share). Synthetic ZeRO-3
tags at tp 2 x dp 1: each tensor rank's files hold its slices, as DeepSpeed 0.19.8's AutoTP writes them."""

from __future__ import annotations

import os

import pytest
import torch

from deepspeed.checkpoint import tp_maps
from deepspeed.checkpoint.ds_to_universal import convert
from deepspeed.checkpoint.files import CheckpointError

VERSION = {"universal_checkpoint_version": 0.4}


def _fused(pattern: str, shape: list, widths=None) -> dict:
    info = {**VERSION, "parameter_with_sub_params": [{"patterns": [pattern], "shape": shape, "partition_dim": 0}]}
    if widths is not None:
        info["sub_param_shard_widths"] = {pattern: widths}
    return info


def _tag(root, slices_by_name: dict[str, list[torch.Tensor]], info: dict, list_state: bool = False) -> str:
    """A ZeRO-3 tag: rank t's files hold slice t of each parameter (fp32; exp_avg = 10 x fp32)."""
    tag = os.path.join(str(root), "step1")
    os.makedirs(tag, exist_ok=True)
    names = list(slices_by_name)
    for t in range(len(slices_by_name[names[0]])):
        flat = torch.cat([slices_by_name[n][t].reshape(-1) for n in names])
        stem = os.path.join(tag, f"zero_pp_rank_0_mp_rank_{t:02d}")
        shapes = [{n: tuple(slices_by_name[n][t].shape) for n in names}]
        torch.save({"param_shapes": shapes, "universal_checkpoint_info": info}, stem + "_model_states.pt")
        state = [{"exp_avg": flat * 10}] if list_state else {0: {"exp_avg": flat * 10}}
        torch.save({"optimizer_state_dict": {"optimizer_state_dict": {"state": state, "param_groups": [{}]},
                                             "fp32_flat_groups": [flat], "zero_stage": 3}},
                   stem + "_optim_states.pt")
    return tag


def _converted(tag: str, name: str, field: str = "fp32") -> torch.Tensor:
    out = tag + "_universal"
    convert(tag, out)
    value = torch.load(os.path.join(out, "zero", name, f"{field}.pt"), weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def test_uneven_sub_param_widths_join_on_head_boundaries(tmp_path) -> None:
    # q/k/v of 6/3/3 rows over 2 ranks cut 4+2 / 2+1 / 2+1: rank 0 holds rows 0-3, 6-7, 9-10
    full = torch.arange(24.0).view(12, 2)
    rows = [[0, 1, 2, 3, 6, 7, 9, 10], [4, 5, 8, 11]]
    tag = _tag(tmp_path, {"qkv.weight": [full[r] for r in rows]},
               _fused(r"^qkv\.weight$", [(6, 3, 3), -1], [[4, 2], [2, 1], [2, 1]]))
    assert torch.equal(_converted(tag, "qkv.weight"), full)
    assert torch.equal(_converted(tag, "qkv.weight", "exp_avg"), full * 10)


def test_a_rank_owning_no_rows_of_a_fused_weight(tmp_path) -> None:
    full = torch.arange(8.0).view(4, 2)
    tag = _tag(tmp_path, {"qkv.weight": [full, full[:0]], "w": [torch.ones(1, 2), torch.ones(1, 2)]},
               _fused(r"^qkv\.weight$", [(2, 1, 1), -1], [[2, 0], [1, 0], [1, 0]]))
    assert torch.equal(_converted(tag, "qkv.weight"), full)


def test_legacy_sub_param_count_is_a_count_not_a_size(tmp_path) -> None:
    # metadata before 0.4: shape (3, -1) means three equal blocks (q, k, v), each split over the ranks
    full = torch.arange(24.0).view(12, 2)
    rows = [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    info = _fused(r"^qkv\.weight$", [3, -1])
    del info["universal_checkpoint_version"]
    tag = _tag(tmp_path, {"qkv.weight": [full[r] for r in rows]}, info)
    assert torch.equal(_converted(tag, "qkv.weight"), full)


def test_replicated_parameter_at_zero3_is_one_copy(tmp_path) -> None:
    fc, ln = torch.arange(16.0).view(4, 4), torch.tensor([1.0, 2.0, 3.0])
    info = {**VERSION, "tp_replicated_parameter_patterns": [r"^ln\.weight$"]}
    tag = _tag(tmp_path, {"fc.weight": [fc[:2], fc[2:]], "ln.weight": [ln, ln]}, info, list_state=True)
    assert torch.equal(_converted(tag, "ln.weight"), ln)
    assert torch.equal(_converted(tag, "fc.weight"), fc)


def test_uneven_plain_split_joins_by_each_rank_slice(tmp_path) -> None:
    full = torch.arange(20.0).view(5, 4)
    info = {**VERSION, "parameter_with_row_parallelism_patterns": []}
    tag = _tag(tmp_path, {"fc.weight": [full[:3], full[3:]]}, info)
    assert torch.equal(_converted(tag, "fc.weight"), full)


def test_unsupported_layout_is_refused_by_name(tmp_path) -> None:
    info = {**VERSION, "autotp_unsupported_parameter_patterns": {r"^qkv\.weight$": "interleaved heads"}}
    tag = _tag(tmp_path, {"qkv.weight": [torch.ones(2, 2), torch.ones(2, 2)]}, info)
    with pytest.raises(CheckpointError, match=r"not supported for \^qkv.*weight\$: interleaved heads"):
        convert(tag, tag + "_universal")


def test_even_guess_refused_for_uneven_blocks_without_widths() -> None:
    with pytest.raises(CheckpointError, match=r"qkv.weight: sub-parameter sizes \[8, 4, 4\] not divisible by "
                                              r"tp_world_size 3.*no sub_param_shard_widths"):
        tp_maps.split_map((16, 2), 0, [8, 4, 4], 3, name="qkv.weight")
    with pytest.raises(CheckpointError, match=r"w: dim 0 of size 10 not divisible by tp_world_size 4.*partition_sizes"):
        tp_maps.split_map((10, 2), 0, None, 4, name="w")
    amap = tp_maps.split_map((10, 2), 0, None, 4, [3, 3, 2, 2], name="w")
    assert amap.shard_shapes == {0: (3, 2), 1: (3, 2), 2: (2, 2), 3: (2, 2)}


def test_inject_missing_state_joins_an_undescribed_tp_checkpoint_on_dim_0(tmp_path) -> None:
    full = torch.arange(8.0).view(4, 2)
    tag = _tag(tmp_path, {"w": [full[:2], full[2:]]}, None)
    with pytest.raises(CheckpointError, match="name no partition dims"):
        convert(tag, tag + "_universal")
    convert(tag, tag + "_universal", inject_missing_state=True)   # upstream's --inject_missing_state
    value = torch.load(os.path.join(tag + "_universal", "zero", "w", "fp32.pt"), weights_only=False)
    assert torch.equal(value["param"], full) and value["cat_dim"] == 0
