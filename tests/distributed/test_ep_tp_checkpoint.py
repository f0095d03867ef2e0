"""EP x TP checkpoints ([Note: EP x TP checkpoint layout] in deepspeed/runtime/checkpoint/ep_tp_io.py) on 4 gloo
ranks, tp 2 x ep 2: AutoEP x AutoTP and deepspeed.moe.layer.MoE with a Megatron-style mpu save in upstream's
file layout, resume exactly at the same layout, and zero_to_fp32 consolidates the checkpoint into the
unsharded model's state dict (against one process on the same global batch). Jobs: eptp_ckpt_jobs.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from eptp_ckpt_jobs import (autoep_autotp_checkpoint, autoep_continue, autoep_save_universal, load_whole,
                            moe_consolidated_names, moe_continue, moe_mpu_checkpoint, moe_reference, moe_save_universal,
                            reference)
from harness import _POOLS, run_distributed

STEPS = 2


@pytest.fixture(autouse=True, scope="module")
def _fresh_ranks_afterwards():
    """As test_ep_tp.py: these layouts stay current in the pool's processes; close the pool after."""
    yield
    for world in list(_POOLS):
        _POOLS.pop(world).close()


def _check_resume(results: list) -> None:
    """Resuming replays the same operations in the same order on the same values (the weights, the fp32
    masters and Adam's moments are read back bit for bit, the counters and the RNG too): bit-equal."""
    for r in results:
        assert r["resumed"] == r["straight"]
        assert sorted(r["whole_resumed"]) == sorted(r["whole"])
        for name, value in r["whole"].items():
            assert torch.equal(r["whole_resumed"][name], value), name


def _check_consolidated(consolidated: dict, at_save: dict, ref: dict) -> None:
    """zero_to_fp32's state dict is the weights at the save (exactly: fp32 masters) and one process's."""
    assert sorted(consolidated) == sorted(ref)
    for name, want in ref.items():
        torch.testing.assert_close(consolidated[name], at_save[name].float(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(consolidated[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [1, pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_autoep_autotp_save_resume_consolidate(tmp_path, stage: int) -> None:
    results = run_distributed(4, autoep_autotp_checkpoint, "mixtral", str(tmp_path), stage, STEPS)
    files = results[0]["files"]
    # upstream's names: one model-states file per tensor rank, each expert once from the tensor rank holding it
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
            "layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_3_mp_rank_01_model_states.pt"} <= set(files)
    optim = {f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in (0, 1) for t in (0, 1)} if stage else \
        {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_01_optim_states.pt"}
    assert optim <= set(files), files
    _check_resume(results)
    _check_consolidated(results[0]["consolidated"], results[0]["at_save"], reference("mixtral", STEPS, 2))
    sixteen = results[0]["sixteen"]   # save_16bit_model: the whole weights (experts gathered, slices joined)
    assert sorted(sixteen) == sorted(results[0]["at_save"])
    for name, value in results[0]["at_save"].items():
        assert torch.equal(sixteen[name], value), name


@pytest.mark.parametrize("stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_moe_mpu_save_resume_consolidate(tmp_path, stage: int) -> None:
    results = run_distributed(4, moe_mpu_checkpoint, str(tmp_path), stage, STEPS)
    files = results[0]["files"]
    # experts replicated over the tensor pair: each tensor rank writes its copy (upstream's mp_rank_XX)
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "layer_0_expert_3_mp_rank_00_model_states.pt",
            "layer_0_expert_3_mp_rank_01_model_states.pt"} <= set(files), files
    _check_resume(results)
    _check_consolidated(moe_consolidated_names(results[0]["consolidated"]), results[0]["at_save"],
                        moe_reference(STEPS, 2))
    # the script save_checkpoint copies beside the checkpoint runs without the package (python -I, from elsewhere)
    subprocess.run([sys.executable, "-I", str(tmp_path / "zero_to_fp32.py"), str(tmp_path), str(tmp_path / "fp32"),
                    "-t", "t"], check=True, cwd="/", capture_output=True)
    script = torch.load(tmp_path / "fp32" / "pytorch_model.bin")
    assert sorted(script) == sorted(results[0]["consolidated"])
    for name, value in results[0]["consolidated"].items():
        assert torch.equal(script[name], value), name
    from deepspeed.utils.zero_to_fp32 import ZeroCheckpointError, get_fp32_state_dict_from_zero_checkpoint

    optim = tmp_path / "t" / "zero_pp_rank_0_mp_rank_01_optim_states.pt" if stage else \
        tmp_path / "t" / "expp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(optim, weights_only=False)
    state.get("optimizer_state_dict", state)["shapes"]["dense.weight"] = (4, 8)   # a slice the files do not tag
    torch.save(state, optim)
    with pytest.raises(ZeroCheckpointError, match="'dense.weight' has shape \\(4, 8\\) on tensor rank 1"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")   # refused, not joined wrongly


def test_autoep_autotp_loads_at_another_expert_size(tmp_path) -> None:
    """A checkpoint saved at tp 2 x ep 2, loaded by load_checkpoint at tp 2 x ep 4 (experts re-homed, through the
    tag joined whole: moe_io.moe_reader): the whole weights are the saved ones."""
    saved = run_distributed(4, autoep_autotp_checkpoint, "mixtral", str(tmp_path), 1, 1)[0]["at_save"]
    loaded = run_distributed(4, load_whole, "mixtral", str(tmp_path), 1, 2, 4)[0]
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.slow
def test_autoep_autotp_resume_at_another_data_size(tmp_path) -> None:
    """tp 2 x ep 2 keeps its files when only the data-parallel size (and the ZeRO stage) changes: saved on 4
    ranks (dp 2, ZeRO 1), loaded on 2 (dp 1, ZeRO 2), the whole weights are the saved ones."""
    saved = run_distributed(4, autoep_autotp_checkpoint, "mixtral", str(tmp_path), 1, 1)[0]["at_save"]
    _POOLS.pop(4).close()
    loaded = run_distributed(2, load_whole, "mixtral", str(tmp_path), 2)[0]
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def _check_universal(saved: dict, got: list, want: list) -> None:
    """Loaded from the universal form at another layout: exactly the saved whole weights; the continued
    training equals the uninterrupted run at that layout (losses to 1e-6; weights within 5e-6 of each
    tensor's norm: the first steps ran at tp 2 x ep 2, another reduction order, measured 1.5e-6 after
    Adam's 4 steps)."""
    for g, w in zip(got, want):
        assert sorted(g["loaded"]) == sorted(saved)
        for name, value in saved.items():
            assert torch.equal(g["loaded"][name], value), name
        assert g["losses"] == pytest.approx(w["losses"][STEPS:], rel=1e-6)
        for name, value in w["whole"].items():
            error = float((g["whole"][name] - value).norm() / value.norm())
            assert error < 5e-6, (name, error)


def _universal_files(tag: str) -> dict:
    import os

    return {name: torch.load(os.path.join(tag, "zero", name, "exp_avg.pt"), weights_only=False)
            for name in os.listdir(os.path.join(tag, "zero")) if name != "optimizer_state.pt"}


@pytest.mark.parametrize("tp,ep,world", [(1, 1, 2), pytest.param(1, 2, 2, marks=pytest.mark.slow)])
def test_autoep_autotp_universal_at_another_layout(tmp_path, tp: int, ep: int, world: int) -> None:
    """AutoEP x AutoTP tp 2 x ep 2 (Adam, ZeRO-1) -> ds_to_universal (TP slices joined along their partition
    dims, experts joined across EP ranks) -> load_universal at tp 1 x ep 1 or ep 2 (dp 2 throughout; AutoTP
    refuses autoep_size 1 at tp 2, as upstream)."""
    saved = run_distributed(4, autoep_save_universal, "mixtral", str(tmp_path), STEPS)[0]
    records = _universal_files(str(tmp_path / "t_universal"))
    experts = records["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["is_expert_param"] is True and experts["ep_num_experts"] == 4 and experts["param"].shape[0] == 4
    assert records["model.layers.0.self_attn.q_proj.weight"]["cat_dim"] == 0   # whole, and joined on dim 0
    assert records["model.layers.0.self_attn.o_proj.weight"]["param"].shape == saved[
        "model.layers.0.self_attn.o_proj.weight"].shape
    assert records["model.layers.0.self_attn.o_proj.weight"]["cat_dim"] == 1   # row-parallel: joined on dim 1
    got = run_distributed(world, autoep_continue, "mixtral", str(tmp_path), "t_universal", 1, tp, ep, STEPS, STEPS)
    want = run_distributed(world, autoep_continue, "mixtral", str(tmp_path), None, 1, tp, ep, 0, 2 * STEPS)
    _check_universal(saved, got, want)
    # a plain load_checkpoint of the tag at this layout reads it joined whole, as the universal form
    _check_universal(saved, run_distributed(world, autoep_continue, "mixtral", str(tmp_path), "t", 1, tp, ep, STEPS,
                                            STEPS), want)


def _moe_universal(tmp_path, tp: int, ep: int, world: int, drop: str | None = None, tag: str = "t_universal") -> tuple:
    saved = run_distributed(4, moe_save_universal, str(tmp_path), STEPS, drop)[0]
    got = run_distributed(world, moe_continue, str(tmp_path), tag, 1, tp, ep, STEPS, STEPS)
    want = run_distributed(world, moe_continue, str(tmp_path), None, 1, tp, ep, 0, 2 * STEPS)
    return saved, got, want


@pytest.mark.parametrize("tp,ep,world", [(2, 1, 4), pytest.param(1, 1, 2, marks=pytest.mark.slow)])
def test_moe_mpu_universal_at_another_layout(tmp_path, tp: int, ep: int, world: int) -> None:
    """deepspeed.moe with an mpu, tp 2 x ep 2 -> ds_to_universal (each global expert once, from tensor rank 0's
    copy) -> load_universal at tp 2 x ep 1 (experts re-homed) or tp 1 x ep 1."""
    _check_universal(*_moe_universal(tmp_path, tp, ep, world))


@pytest.mark.slow
def test_moe_mpu_plain_load_at_another_layout(tmp_path) -> None:
    """load_checkpoint of the tp 2 x ep 2 tag itself at tp 2 x ep 1 (read joined whole, as its universal form)."""
    _check_universal(*_moe_universal(tmp_path, 2, 1, 4, tag="t"))


def test_moe_mpu_universal_sees_a_dropped_moment(tmp_path) -> None:
    """The comparison above sees the moments: exp_avg_sq zeroed in the universal files fails it."""
    saved, got, want = _moe_universal(tmp_path, 2, 1, 4, drop="exp_avg_sq")
    with pytest.raises(AssertionError):
        _check_universal(saved, got, want)
