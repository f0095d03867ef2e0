"""DeepSpeed 0.19.8's ZeRO-1/2 AutoEP (and `deepspeed.moe`) optimizer files as named pieces ([Note: DeepSpeed's
ZeRO-1/2 AutoEP optimizer files]): what the fixtures' files give, and files the rule does not fix exactly refused
naming the file."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

from deepspeed.checkpoint.files import CheckpointError
from deepspeed.runtime.checkpoint.autoep_ds_zero12 import is_deepspeed_zero12, pieces_of

TAG = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_autoep_zero1", "ckpt", "t")


MOE_TAG = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_moe_zero2", "ckpt", "t")


def _load(tag: str) -> tuple:
    found = sorted(glob.glob(os.path.join(tag, "zero_pp_rank_*_optim_states.pt")))
    states = [torch.load(f, weights_only=False) for f in found]
    return found, states, torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)


@pytest.fixture(scope="module")
def saved() -> tuple:
    return _load(TAG)


@pytest.fixture(scope="module")
def moe_saved() -> tuple:
    """DeepSpeed's own `deepspeed.moe` ZeRO-2 files (per-expert tensors named by local ids)."""
    return _load(MOE_TAG)


def test_pieces_cover_every_parameter_once(saved) -> None:
    found, states, model = saved
    out = pieces_of(TAG, found, states, model, count=1)
    assert [s["step"] for s in out] == [2.0, 2.0]
    assert all(len(s["param_groups"]) == 1 and not s["param_groups"][0].get("moe") for s in out)   # folded
    covered: dict[str, int] = {}
    for state in out:
        for name, start, numel, values in state["ds_moe_pieces"]:
            covered[name] = covered.get(name, 0) + numel
            assert sorted(values) == ["exp_avg", "exp_avg_sq", "fp32"]
    shapes = {n: s for state in out for n, s in state["shapes"].items()}
    assert shapes["model.layers.0.mlp.experts.w1"] == (4, 8, 16)   # whole: both EP ranks' rows
    assert covered == {n: torch.Size(s).numel() for n, s in shapes.items()}


@pytest.mark.parametrize("change, words", [
    (lambda s: s["optimizer_state_dict"]["single_partition_of_fp32_groups"].__setitem__(
        1, s["optimizer_state_dict"]["single_partition_of_fp32_groups"][1][:-2]), "flat partition 1 holds 1534"),
    (lambda s: s["optimizer_state_dict"].__setitem__("partition_count", [2, 2]), "partitioned over 2 ranks"),
    (lambda s: s["optimizer_state_dict"].__setitem__("dynamic_loss_scale", True), "dynamic loss scale"),
])
def test_files_the_rule_does_not_fix_are_refused(saved, change, words) -> None:
    found, states, model = saved
    states = copy.deepcopy(states)
    change(states[1])
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt") as err:
        pieces_of(TAG, found, states, model, count=1)
    assert words in str(err.value)


def test_moe_experts_get_global_ids(moe_saved) -> None:
    found, states, model = moe_saved
    assert is_deepspeed_zero12(model, states)
    out = pieces_of(MOE_TAG, found, states, model, count=2)
    experts = [{n for n, *_ in s["ds_moe_pieces"] if "deepspeed_experts" in n} for s in out]
    assert experts == [{f"moes.{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.{p}" for layer in range(2)
                        for e in ids for p in ("weight", "bias")} for ids in ((0, 1), (2, 3))]
    covered: dict[str, int] = {}
    for state in out:
        for name, start, numel, values in state["ds_moe_pieces"]:
            covered[name] = covered.get(name, 0) + numel
    shapes = {n: s for state in out for n, s in state["shapes"].items()}
    assert len(shapes) == 6 + 16 and covered == {n: torch.Size(s).numel() for n, s in shapes.items()}


@pytest.mark.parametrize("num_experts, words", [
    ([4], "num_experts [4] for 2 MoE layers"),
    ([5, 4], "local experts [0, 1] of 5"),
    ([6, 6], "ep_size 3, which does not divide the 2"),
])
def test_moe_layer_records_that_do_not_fit_are_refused(moe_saved, num_experts, words) -> None:
    found, states, model = moe_saved
    named = r"ds_0_19_8_moe_zero2/ckpt/t: |zero_pp_rank_0_mp_rank_00_optim_states.pt: "   # the file, by name
    with pytest.raises(CheckpointError, match=named) as err:
        pieces_of(MOE_TAG, found, states, {**model, "num_experts": num_experts}, count=2)
    assert words in str(err.value)
