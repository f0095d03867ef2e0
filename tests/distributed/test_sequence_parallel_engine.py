"""The engine under sequence parallelism: ZeRO 0-3, both loss conventions, against one process on the
full sequences ([Note: sequence-parallel gradient scale] in deepspeed/runtime/sequence_loss.py).

SGD, not Adam: Adam's update does not see a gradient scaled by sp, SGD's does, and so do the grad norm
and clipping, which are compared too. Not bit-equal: the shards' partial sums reach the gradients in
another order than the single process's, so ~1e-6 relative (fp32)."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import assert_params_close
from sp_engine_jobs import reference, train_sp

STEPS = 3


_check = assert_params_close


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("convention", ["whole", "share"])
def test_sp2_dp2_matches_full_sequence(stage, convention):
    ref = reference(STEPS, dp=2, micro=2, gas=1, lr=0.5, clip=1.0)
    results = run_distributed(4, train_sp, STEPS, 2, stage, convention, clip=1.0)
    _check(results, ref)
    for result in results:   # the norm the engine clipped with is the full model's, not sp x it
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_sp4_with_accumulation(stage):
    ref = reference(STEPS, dp=1, micro=1, gas=2, lr=0.5, clip=0.0)
    _check(run_distributed(4, train_sp, STEPS, 4, stage, "whole", micro=1, gas=2), ref)


def test_sp2_world2_share_convention_bf16_tracks_fp32():
    ref = reference(STEPS, dp=1, micro=2, gas=1, lr=0.5, clip=0.0)
    _check(run_distributed(2, train_sp, STEPS, 2, 2, "share", dtype="bf16"), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_saved_with_sp2_resumes_with_sp2_and_sp1(tmp_path, stage):
    """ZeRO shards over data x sequence, so the files hold sp x dp partitions: they load at SP=2, at SP=1
    on the same world (dp 4) and on another world size, and zero_to_fp32 consolidates them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    saved = run_distributed(4, train_sp, 2, 2, stage, "whole", extra=adam, save_dir=str(tmp_path))[0]
    for world, sp in ((4, 2), (4, 1), (2, 1)):
        loaded = run_distributed(world, train_sp, 0, sp, stage, "whole", extra=adam, load_dir=str(tmp_path))
        for result in loaded:
            for name, value in saved["params"].items():   # a load moves bytes: exact
                assert torch.equal(result["params"][name], value), (world, sp, name)
                assert torch.equal(result["exp_avg"][name], saved["exp_avg"][name]), (world, sp, name)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="sp")
    for name, value in saved["params"].items():
        assert torch.equal(consolidated[name].float(), value), name


def test_sp_groups_handed_over_as_mpu():
    """`parallel_state_sp` as `mpu=` (what register_with_transformers returns) gives the same training."""
    ref = reference(STEPS, dp=2, micro=2, gas=1, lr=0.5, clip=0.0)
    _check(run_distributed(4, train_sp, STEPS, 2, 2, "share", via_mpu=True), ref)


def _group_layout(sp: int) -> dict:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.utils import groups
    import deepspeed.comm as dist

    groups.mpu = None   # this pool's earlier jobs may have handed an engine another mpu (a pipeline grid)
    mpu.initialize_sequence_parallel(sp)
    probe = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(probe, group=groups._get_sequence_parallel_group())
    return {"sp": (groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()),
            "dp": (groups._get_data_parallel_rank(), groups._get_data_parallel_world_size()),
            "spdp": (groups._get_sequence_data_parallel_rank(), groups._get_sequence_data_parallel_world_size()),
            "sum": probe.item(), "mp": groups._get_model_parallel_world_size()}


def test_group_accessors_follow_upstreams_rank_order():
    layout = run_distributed(4, _group_layout, 2)
    assert [r["sp"] for r in layout] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["dp"] for r in layout] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["spdp"] for r in layout] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [r["sum"] for r in layout] == [1.0, 1.0, 5.0, 5.0]   # sequence groups [0, 1] and [2, 3]
    assert all(r["mp"] == 1 for r in layout)


def _loader_batches() -> list:
    import deepspeed

    from sp_engine_jobs import CausalMixLM

    data = torch.utils.data.TensorDataset(torch.arange(16).view(16, 1))
    engine, _, loader, _ = deepspeed.initialize(
        model=CausalMixLM(), training_data=data,
        config={"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return [batch[0].view(-1).tolist() for batch in loader]


def test_sequence_ranks_share_their_replicas_batches():
    """The engine's loader deals samples to data-parallel replicas: the SP ranks of one replica get the same."""
    batches = run_distributed(4, _loader_batches)
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert sorted(sum(batches[0] + batches[2], [])) == list(range(16))   # the two replicas split the data


def _expert_layout() -> dict:
    from deepspeed.runtime import mesh
    from deepspeed.utils import groups
    import deepspeed.comm as dist

    groups.mpu = None
    mesh.reset()
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(2)   # a second call builds nothing new
    probe = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(probe, group=groups._get_expert_parallel_group("ep_size_2"))
    replica = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(replica, group=groups._get_expert_data_parallel_group("ep_size_2"))
    return {"ep": groups._get_expert_parallel_group_ranks("ep_size_2"),
            "edp": groups._get_expert_data_parallel_group_ranks("ep_size_2"),
            "rank": (groups._get_expert_parallel_rank("ep_size_2"), groups._get_expert_data_parallel_rank("ep_size_2")),
            "sums": (probe.item(), replica.item()), "max": groups._get_max_expert_size_name()}


def test_expert_groups_on_the_mesh():
    layout = run_distributed(4, _expert_layout)
    assert [r["ep"] for r in layout] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["edp"] for r in layout] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["rank"] for r in layout] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["sums"] for r in layout] == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]
    assert all(r["max"] == "ep_size_2" for r in layout)


@pytest.mark.parametrize("stage", [0, 3])
def test_declared_share_convention_with_coinciding_shares(stage):
    """Every SP rank holds the same sequence shard (each sequence is its first half twice, tokens not mixed),
    so the per-rank shares of the loss are bitwise equal: a value test takes them for a whole loss and
    trains with 1/sp of the gradient. Declared (`engine.sequence_parallel_loss = "share"`), the gradient is
    the full sequence's, and no backward runs the value test."""
    ref = reference(STEPS, dp=1, micro=2, gas=1, lr=0.5, clip=0.0, repeat=2, mix_tokens=False)
    results = run_distributed(2, train_sp, STEPS, 2, stage, "share", repeat=2, mix_tokens=False, declare="share")
    _check(results, ref)
    assert results[0]["losses"] == results[1]["losses"]   # the shares coincide
    assert all(r["value_tests"] == [0] * STEPS for r in results)


@pytest.mark.parametrize("convention,declare,tests", [("whole", "whole", [1, 0, 0]), ("share", None, [1, 1, 1])])
def test_value_test_runs_only_while_the_convention_is_unknown(convention, declare, tests):
    """A declared "whole" is cross-checked at the first backward only; an unknown convention is tested at
    every backward (one all_gather of the scalar and a host sync each); gradients exact either way."""
    ref = reference(STEPS, dp=1, micro=2, gas=1, lr=0.5, clip=0.0)
    results = run_distributed(2, train_sp, STEPS, 2, 1, convention, declare=declare)
    _check(results, ref)
    assert all(r["value_tests"] == tests for r in results)


def test_bare_backward_of_a_declared_share_is_scaled_by_sp():
    ref = reference(STEPS, dp=1, micro=2, gas=1, lr=0.5, clip=0.0)
    _check(run_distributed(2, train_sp, STEPS, 2, 2, "share", declare="share", bare=True), ref)


def test_declared_whole_with_per_rank_shares_raises_on_every_rank():
    with pytest.raises(Exception, match="differs across the 2 sequence-parallel ranks.*"
                                        "engine.sequence_parallel_loss = 'whole'.*set engine.sequence_parallel_loss"):
        run_distributed(2, train_sp, 1, 2, 0, "share", declare="whole")
