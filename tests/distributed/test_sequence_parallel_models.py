"""Real models under the engine with sequence parallelism, 4 ranks, against one process on the full
sequences (sp_models_jobs.py): a tiny HF Llama through ALST (UlyssesSPAttentionHF + the data-loader
adapter, HF's token-weighted loss join) and a plain GPT through DistributedAttention (local-share loss).
Per step the replica losses and the clipped gradient norm, the first step's whole gradients and the
weights after 10 SGD steps (scale-sensitive, unlike Adam) agree to fp32 rounding: not bit-equal, the
shards' partial sums reach the gradients in another order than the single process's.

The default run keeps one of each kind (SP x DP, SP=4 with GQA replication and variable lengths, bf16,
the GPT); the remaining ZeRO stages are marked slow."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from sp_models_jobs import adapter_shards, gpt_reference, llama_reference, train_gpt, train_llama

STEPS, LR, CLIP = 10, 0.5, 1.0


def _check(results: list[dict], ref: dict, dp: int, rtol: float = 2e-5, atol: float = 2e-6, grads: bool = True):
    sp = len(results) // dp
    for rank, result in enumerate(results):
        d = rank // sp   # sequence groups are runs of consecutive ranks
        want = [row[d] for row in ref["losses"]]
        assert result["losses"] == pytest.approx(want, rel=rtol, abs=atol), (rank, result["losses"], want)
        assert result["norms"] == pytest.approx(ref["norms"], rel=max(rtol, 1e-5)), (rank, result["norms"])
        for what in ("params", "grads0") if grads else ("params", ):
            for name, value in ref[what].items():
                torch.testing.assert_close(result[what][name], value, rtol=rtol, atol=atol,
                                           msg=lambda m: f"rank {rank} {what} {name}: {m}")
    assert max(ref["norms"]) > CLIP, ref["norms"]   # clipping engaged: a wrong gradient scale shows


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("stage", [pytest.param(0, marks=_SLOW), pytest.param(1, marks=_SLOW), 2,
                                   pytest.param(3, marks=_SLOW)])
def test_llama_alst_sp2_dp2_fixed_length(stage):
    ref = llama_reference(STEPS, dp=2, micro=2, variable=False, lr=LR, clip=CLIP)
    _check(run_distributed(4, train_llama, STEPS, 2, stage, lr=LR, clip=CLIP), ref, dp=2)


@pytest.mark.parametrize("stage", [pytest.param(0, marks=_SLOW), pytest.param(1, marks=_SLOW),
                                   pytest.param(2, marks=_SLOW), 3])
def test_llama_alst_sp4_gqa_variable_lengths(stage):
    """SP=4 with 2 key/value heads: ALST replicates them; lengths 8-32 change from one draw to the next."""
    ref = llama_reference(STEPS, dp=1, micro=1, variable=4, lr=LR, clip=CLIP)
    _check(run_distributed(4, train_llama, STEPS, 4, stage, micro=1, variable=4, lr=LR, clip=CLIP), ref, dp=1)


def test_alst_loss_is_taken_whole_without_a_value_test_after_the_first():
    """ALST's attention in the model tells the engine the loss is the replica's whole one on every SP rank:
    the value test runs once, as a cross-check, not at every backward; gradients exact."""
    ref = llama_reference(STEPS, dp=1, micro=2, variable=False, lr=LR, clip=CLIP)
    results = run_distributed(2, train_llama, STEPS, 2, 1, lr=LR, clip=CLIP)
    _check(results, ref, dp=1)
    assert all(r["value_tests"] == [1] + [0] * (STEPS - 1) for r in results)


def test_alst_with_per_rank_share_losses_raises_on_every_rank():
    with pytest.raises(Exception, match="differs across the 2 sequence-parallel ranks.*UlyssesSPAttentionHF.*"
                                        "deepspeed_sp_compute_loss.*sequence_parallel_loss = 'share'"):
        run_distributed(2, train_llama, 1, 2, 0, join=False)


def test_llama_alst_each_sequence_rank_draws_its_own_length():
    """The batches an SP group's ranks draw together differ in length (the adapter gathers them by size)."""
    ref = llama_reference(STEPS, dp=2, micro=2, variable=1, lr=LR, clip=CLIP)
    _check(run_distributed(4, train_llama, STEPS, 2, 2, variable=1, lr=LR, clip=CLIP), ref, dp=2)


def test_llama_alst_bf16_tracks_fp32():
    ref = llama_reference(STEPS, dp=2, micro=2, variable=0, lr=LR, clip=CLIP)
    results = run_distributed(4, train_llama, STEPS, 2, 1, lr=LR, clip=CLIP, dtype="bf16")
    _check(results, ref, dp=2, rtol=5e-2, atol=2e-2, grads=False)


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=_SLOW), pytest.param(2, marks=_SLOW),
                                   pytest.param(3, marks=_SLOW)])
@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=_SLOW)])
def test_gpt_distributed_attention_local_share_loss(sp, stage):
    dp = 4 // sp
    ref = gpt_reference(STEPS, dp=dp, micro=2, lr=LR, clip=CLIP)
    _check(run_distributed(4, train_gpt, STEPS, sp, stage, lr=LR, clip=CLIP), ref, dp=dp)


def test_adapter_shards_are_contiguous():
    """What a client's loss does with them: `shift_labels.view(-1)` needs contiguous shards."""
    for rank, shards in enumerate(run_distributed(2, adapter_shards, 2, 2)):
        assert shards and all(all(s.values()) for s in shards), (rank, shards)
