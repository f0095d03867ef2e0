"""AutoTP in the engine ([Note: AutoTP in the engine] in deepspeed/runtime/engine_parallel.py): TP=2 on
2 ranks and TP=2 x DP=2 on 4 ranks, ZeRO 0-2, against one process training the unsharded model on the
same global batch. Not bit-equal: the row layers' partial products are summed in another order, so
~1e-6 relative (fp32)."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import assert_params_close
from tp_engine_jobs import HIDDEN, SEQ, VOCAB, reference, tp_input_check, tp_model_init_rules, train_tp

STEPS = 3


_check = assert_params_close


def _check_losses(results: list[dict], ref: dict, tp: int, dp: int) -> None:
    for rank, result in enumerate(results):
        dp_rank = rank // tp
        want = [ref["losses"][step * dp + dp_rank] for step in range(STEPS)]
        assert result["losses"] == pytest.approx(want, rel=1e-5), rank


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_tp2_dp2_llama_matches_one_process(stage):
    ref = reference("llama", STEPS, dp=2, micro=2, lr=0.5, clip=1.0)
    results = run_distributed(4, train_tp, "llama", STEPS, 2, stage, clip=1.0)
    _check(results, ref)
    _check_losses(results, ref, tp=2, dp=2)
    for result in results:   # the clipped norm is the whole model's: shards once, replicated once
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    batches = [r["first_batch"] for r in results]   # deepspeed_io: TP peers (0,1), (2,3) share a batch
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    assert [r["tp_src"] for r in results] == [0, 0, 2, 2]   # groups.get_tensor_model_parallel_src_rank


@pytest.mark.parametrize("stage,via_init,preset", [(1, False, False), (2, True, False), (0, False, True)])
def test_tp2_qwen3_norms_sum_their_gradient_over_tp(stage, via_init, preset):
    """Qwen3's tp_plan (and the qwen3 preset) keeps the per-head q_norm/k_norm whole
    (`replicated_with_grad_allreduce`) after a column q/k_proj: each TP rank's backward sees only its heads'
    share of their gradient, summed over the TP group before ZeRO; with 2 micro-steps of gradient
    accumulation the weights equal one process's."""
    ref = reference("qwen3", STEPS, dp=2, micro=2, lr=0.5, clip=1.0)
    extra = {"tensor_parallel": {"autotp_size": 2, "preset_model": "qwen3"}} if preset else None
    results = run_distributed(2, train_tp, "qwen3", STEPS, 2, stage, clip=1.0, via_init=via_init, accumulate=2,
                              extra=extra)
    for result in results:
        for name in ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
            torch.testing.assert_close(result["params"][name], ref["params"][name], rtol=2e-5, atol=2e-6)
    _check(results, ref)
    for result in results:
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert "model.layers.0.self_attn.q_proj.weight" in result["sharded"]


@pytest.mark.parametrize("stage,via_init", [(0, False), (2, True)])
def test_tp2_mlp_matches_one_process(stage, via_init):
    ref = reference("mlp", STEPS, dp=1, micro=2, lr=0.5, clip=0.5)
    results = run_distributed(2, train_tp, "mlp", STEPS, 2, stage, clip=0.5, via_init=via_init)
    _check(results, ref)
    _check_losses(results, ref, tp=2, dp=1)
    for result in results:
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert result["sharded"] == ["block.down.weight", "block.up.bias", "block.up.weight"]
        for name, numel in result["full_numel"].items():   # 1/tp of every sharded weight, whole otherwise
            share = 2 if name in result["sharded"] else 1
            assert result["local_numel"][name] * share == numel, name
            assert result["after_numel"][name] == result["local_numel"][name], name   # sliced again on exit


@pytest.mark.parametrize("kind,hidden,per_step", [
    ("mlp", HIDDEN, 2),        # the pair: row output forward, column input gradient backward
    # per layer: o_proj, down_proj forward; the inputs of q/k/v and of gate/up backward, once each (their
    # column layers share one all-reduce: [Note: one input-gradient all-reduce per shared input]); lm_head's input
    ("llama", 64, 2 * 4 + 1),
])
def test_tp_all_reduce_bytes_match_theory(kind, hidden, per_step):
    """Every TP all-reduce of a forward/backward is one [micro, seq, hidden] fp32 tensor, as many as the
    layers' theory says; nothing else all-reduces during forward/backward at DP=1."""
    micro = 2
    results = run_distributed(2, train_tp, kind, 2, 2, 0, micro=micro, count_bytes=True)
    for result in results:
        assert result["bytes"] == [("torch.float32", micro * SEQ * hidden * 4)] * per_step * 2


def test_tp2_dp2_zero3_matches_one_process(tmp_path):
    """ZeRO-3 partitions each rank's TP slices over its data group: losses, clipped norms and whole
    weights (GatherReplacedLayerParams, save_16bit_model) equal one process."""
    ref = reference("mlp", STEPS, dp=2, micro=2, lr=0.5, clip=0.5)
    zero3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    results = run_distributed(4, train_tp, "mlp", STEPS, 2, 3, clip=0.5, save_16bit=str(tmp_path), extra=zero3)
    _check(results, ref)
    _check_losses(results, ref, tp=2, dp=2)
    for result in results:
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    for name, value in ref["params"].items():
        torch.testing.assert_close(saved[name], value, rtol=2e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoint_resume_at_the_same_tp_size(tmp_path, stage):
    """TP=2 x DP=2: each tensor rank writes its mp_rank_XX files (its slices and their optimizer state;
    at ZeRO-3 one model-states file per data and tensor rank); 2 steps, save, resume in fresh processes,
    1 more step equals 3 uninterrupted steps (SGD momentum)."""
    import os

    ref = reference("mlp", 3, dp=2, micro=2, lr=0.5, clip=0.0, momentum=0.9)
    saved = run_distributed(4, train_tp, "mlp", 2, 2, stage, momentum=0.9, save_dir=str(tmp_path))[0]["params"]
    names = sorted(os.listdir(tmp_path / "tp"))
    model = "zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt" if stage == 3 else "mp_rank_{1:02d}_model_states.pt"
    assert all(model.format(d, m) in names for d in (0, 1) for m in (0, 1)), names
    _check(run_distributed(4, train_tp, "mlp", 1, 2, stage, momentum=0.9, load_dir=str(tmp_path), start=2), ref)
    if stage > 0:   # zero_to_fp32 joins the tensor ranks' slices: the whole fp32 weights
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="tp")
        assert sorted(consolidated) == sorted(saved)
        for name, value in saved.items():
            assert torch.equal(consolidated[name].float(), value), name


def test_save_16bit_model_writes_whole_weights(tmp_path):
    ref = reference("llama", 1, dp=1, micro=2, lr=0.5, clip=0.0)
    run_distributed(2, train_tp, "llama", 1, 2, 1, save_16bit=str(tmp_path))
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(saved) == sorted(ref["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(saved[name], value, rtol=2e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("precision", [{"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True, "initial_scale_power": 8}}])
def test_tp2_16bit_zero1_tracks_fp32(precision):
    """bf16/fp16 compute with fp32 masters: the sharded masters are the slices (the whole weights gathered
    here are the 16-bit ones), close to the fp32 reference; fp16's overflow check runs over the TP group."""
    ref = reference("mlp", STEPS, dp=1, micro=2, lr=0.5, clip=1.0)
    results = run_distributed(2, train_tp, "mlp", STEPS, 2, 1, clip=1.0, extra=precision)
    for result in results:
        for name, value in ref["params"].items():
            torch.testing.assert_close(result["params"][name].float(), value, rtol=3e-2, atol=3e-2)
        assert result["norms"] == pytest.approx(ref["norms"], rel=3e-2)


def test_tp2_dp2_activation_checkpointing_inside_the_tp_pair():
    """deepspeed.checkpointing around the column/row pair: the recompute in backward repeats the row
    all-reduce on every TP rank in the same order, and the result is the unsharded model's."""
    ref = reference("mlp", STEPS, dp=2, micro=2, lr=0.5, clip=1.0)
    results = run_distributed(4, train_tp, "mlp", STEPS, 2, 1, clip=1.0, checkpoint_block=True)
    _check(results, ref)
    _check_losses(results, ref, tp=2, dp=2)


@pytest.fixture(scope="module")
def muon_unsharded():
    from tp_engine_jobs import muon_with_tp

    return run_distributed(1, muon_with_tp, "config", 1, 0)[0]


@pytest.mark.parametrize("how,world,stage", [("config", 2, 0), ("tp_model_init", 2, 1), ("client", 2, 3),
                                             ("config", 4, 2)])
def test_muon_with_tp_equals_unsharded(muon_unsharded, how, world, stage):
    """Muon x AutoTP (TP=2; x DP=2 on 4 ranks): each sliced matrix's direction is gathered over the tensor
    group and orthogonalised whole ([Note: Muon under tensor parallelism]), so every step equals the
    unsharded run (itself equal to torch.optim.Muon: test_muon_zero.py). Newton-Schulz of the slices would
    move the Muon weights by O(lr); "standard" NS rounds to bf16, so almost every element is bit-equal
    and the rest within a bf16 ulp of the update, as in test_muon_zero.py."""
    from tp_engine_jobs import muon_with_tp

    lr = 0.02
    for result in run_distributed(world, muon_with_tp, how, 2, stage):
        for step, (got, want) in enumerate(zip(result["history"], muon_unsharded["history"])):
            for name, value in want.items():
                if name in muon_unsharded["sliced"]:
                    same = (got[name] == value).float().mean().item()
                    gap = (got[name] - value).abs().max().item()
                    assert same >= 0.99 and gap <= lr * 2**-6 * (step + 1), (how, stage, step, name, same, gap)
                else:
                    torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # the sliced matrices' directions crossed the tensor group
        assert result["gathered"] > 0


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_muon_with_tp_checkpoint_resumes_exactly(tmp_path, stage):
    """Muon x AutoTP checkpoints (each tensor rank's slices and their momentum, the AdamW moments of the
    rest): 2 steps, save, resume in fresh engines, 1 more step gives the uninterrupted run's weights bit
    for bit (the same layout runs the same operations in the same order on values read back exactly)."""
    from tp_engine_jobs import muon_with_tp

    uninterrupted = run_distributed(2, muon_with_tp, "config", 2, stage, 3)
    run_distributed(2, muon_with_tp, "config", 2, stage, 2, str(tmp_path))
    resumed = run_distributed(2, muon_with_tp, "config", 2, stage, 1, None, str(tmp_path), 2)
    for got, want in zip(resumed, uninterrupted):
        for name, value in want["history"][-1].items():
            assert torch.equal(got["history"][-1][name], value), name


def test_fused_gate_up_shape_split_per_block(tmp_path):
    """`shape: [2, -1]` on a fused [gate; up] Linear: each rank holds half of gate and half of up (an even
    split of the whole weight would give rank 0 all of gate, and wrong maths); ZeRO-2 TP=2 equals one
    process, the local weight is 1/2 of it, and zero_to_fp32 joins the slices block by block."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref = reference("glu", STEPS, dp=1, micro=2, lr=0.5, clip=1.0)
    results = run_distributed(2, train_tp, "glu", STEPS, 2, 2, clip=1.0, save_dir=str(tmp_path))
    _check(results, ref)
    _check_losses(results, ref, tp=2, dp=1)
    for result in results:
        assert result["local_numel"]["block.gate_up.weight"] == result["full_numel"]["block.gate_up.weight"] // 2
        assert "block.gate_up.bias" in result["sharded"]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="tp")
    for name, value in results[0]["params"].items():
        assert torch.equal(consolidated[name].float(), value), name


def test_head_count_not_divisible_by_tp_refused_on_every_rank():
    """num_key_value_heads=1 at autotp_size=2: a head would straddle two ranks; every rank raises."""
    with pytest.raises(Exception, match="num_key_value_heads=1 is not divisible by autotp_size=2"):
        run_distributed(2, train_tp, "llama-kv1", 1, 2, 0)


def test_tp_model_init_records_its_arguments_for_initialize():
    """As upstream: `initialize` takes a missing autotp_size from tp_model_init, refuses its tp_group next to an
    mpu and a dtype other than the config's; `groups._init_tp_mesh_device` returns the mesh's DP and TP groups."""
    results = run_distributed(4, tp_model_init_rules)
    for rank, result in enumerate(results):
        tensor = [rank - rank % 2, rank - rank % 2 + 1]
        assert result["mesh"] == ([rank % 2, rank % 2 + 2], tensor, tensor)
        assert result["recorded"] == (2, 2)
        assert result["gather"] == (True, True, True)
        assert result["tp_group_and_mpu"].startswith("ValueError: tp_model_init provided tp_group"), result
        assert result["dtype"].startswith("ValueError: Conflicting dtype"), result


def test_first_forward_refuses_different_inputs_on_tp_peers():
    from deepspeed.runtime.tensor_parallel.input_check import MESSAGE

    assert run_distributed(2, tp_input_check) == [[MESSAGE, "ok"]] * 2


def _replicated_bytes(result: dict) -> int:
    return 4 * sum(n for name, n in result["full_numel"].items() if name not in result["sharded"])


@pytest.mark.parametrize("stage,extra", [(0, None), (0, {"bf16": {"enabled": True}}), (1, None), (3, None)])
def test_replicated_params_cannot_drift_across_tp_ranks(stage, extra):
    """[Note: TP-replicated gradients]: TP rank 1 adds 1e-3 to every gradient of its replicated parameters
    (embedding, norm, row bias, lm_head), standing for a nondeterministic kernel; after 3 steps (SGD with
    momentum) the replicated parameters are still bitwise equal on both TP ranks, at every ZeRO stage."""
    results = run_distributed(2, train_tp, "mlp", STEPS, 2, stage, clip=1.0, momentum=0.9, perturb=1e-3,
                              extra=extra)
    replicated = [n for n in results[0]["params"] if n not in results[0]["sharded"]]
    assert "embed.weight" in replicated and "block.down.bias" in replicated
    for name in replicated:
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


@pytest.mark.parametrize("world,stage", [(2, 0), (4, 2)])
def test_replicated_grad_average_costs_their_grad_bytes(world, stage):
    """The cost of the TP average, counted by deepspeed.comm: one fp32 all-reduce per step of the replicated
    parameters' gradient bytes (besides it a step without clipping all-reduces only scalars: ZeRO's
    agreement checks); at ZeRO-2 with DP=2 each data rank averages only the fragments it owns, so the data
    ranks' bytes add up to them."""
    results = run_distributed(world, train_tp, "mlp", 2, 2, stage)
    want = _replicated_bytes(results[0])
    assert want == 4 * (2 * VOCAB * HIDDEN + 3 * HIDDEN)   # embed, lm_head; norm weight and bias, down.bias
    per_rank = []
    for result in results:
        steps = [[r for r in reduces if r[0] > 8] for reduces in result["step_reduces"]]
        for reduces in steps:
            assert len(reduces) == 1 and reduces[0][1] == "torch.float32", reduces
        assert len({reduces[0][0] for reduces in steps}) == 1
        per_rank.append(steps[0][0][0])
    assert per_rank[0::2] == per_rank[1::2]   # TP peers average the same fragments
    assert sum(per_rank[0::2]) == want, (per_rank, want)


def test_replicated_sync_averages_and_refuses_misaligned_peers():
    from tp_engine_jobs import replicated_sync_direct

    assert run_distributed(2, replicated_sync_direct, False) == [[[2.0] * 4, [0.0] * 3, [4.0] * 2],
                                                                 [[2.0] * 4, [1.0] * 3, [4.0] * 2]]
    for result in run_distributed(2, replicated_sync_direct, True):
        assert "laid out differently" in result[0] and "whole.weight" in result[0], result
