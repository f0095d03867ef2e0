"""Ulysses/ALST sequence parallelism x AutoTP tensor parallelism on one mesh ([Note: SP x TP] in
deepspeed/runtime/sequence_parallel/ulysses_sp.py): a tiny HF Llama (4 query heads, 2 key/value heads) at
world 4 = sp 2 x tp 2 equals one process training the unsharded model on the same global batch: losses per
step, the clipped global norm, the whole final weights (fp32; not bit-equal: the row layers' partial sums
and the shards' gradients reach the result in another order)."""

from __future__ import annotations

import pytest

from harness import run_distributed
from models import assert_params_close
from sp_models_jobs import llama_reference
from sp_tp_jobs import autotp_with_own_mpu, register_then_initialize, sp_tp_load, sp_tp_resume, train_llama_sp_tp

STEPS, LR, CLIP = 6, 0.5, 1.0


def _check(results: list[dict], ref: dict, sp: int, tp: int) -> None:
    for rank, result in enumerate(results):
        d = rank // (sp * tp)   # pipe x data x sequence x tensor, tensor fastest
        assert result["dp_rank"] == d
        want = [row[d] for row in ref["losses"]]
        assert result["losses"] == pytest.approx(want, rel=1e-5), (rank, result["losses"], want)
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5), (rank, result["norms"], ref["norms"])
    assert_params_close(results, ref, rtol=1e-5, atol=1e-6)
    assert max(ref["norms"]) > CLIP, ref["norms"]   # clipping engaged: a wrong gradient scale shows


@pytest.mark.parametrize("stage,tp_first", [(0, False), (1, False), (2, False), (3, False), (2, True)])
def test_llama_alst_sp2_autotp2_matches_one_process(stage, tp_first):
    ref = llama_reference(STEPS, dp=1, micro=2, variable=0, lr=LR, clip=CLIP)
    results = run_distributed(4, train_llama_sp_tp, STEPS, 2, 2, stage, lr=LR, clip=CLIP, tp_first=tp_first)
    _check(results, ref, sp=2, tp=2)
    # the rank order: tensor innermost, the sequence groups strided by tp, ZeRO over data x sequence
    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["sp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["zero_ranks"] == 2 for r in results)
    assert all("model.layers.0.self_attn.q_proj.weight" in r["sharded"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_llama_alst_dp2_sp2_autotp2_on_8_ranks(stage):
    ref = llama_reference(STEPS, dp=2, micro=2, variable=0, lr=LR, clip=CLIP)
    results = run_distributed(8, train_llama_sp_tp, STEPS, 2, 2, stage, lr=LR, clip=CLIP)
    _check(results, ref, sp=2, tp=2)
    assert [r["sp_ranks"] for r in results][:4] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["zero_ranks"] == 4 for r in results)


@pytest.mark.parametrize("stage", [1, 3])
def test_sp2_tp2_checkpoint_resumes_at_the_same_layout(stage, tmp_path):
    """sp 2 x tp 2 (AdamW): save after 2 steps, a fresh engine loads and trains 2 more: the same losses and
    whole weights as the uninterrupted run; the files are upstream's (`mp_rank_0t` per tensor rank, ZeRO
    optimizer files per data x sequence rank); zero_to_fp32 joins the TP slices into the whole model."""
    import os

    import torch

    results = run_distributed(4, sp_tp_resume, stage, str(tmp_path))
    names = set(os.listdir(tmp_path / "t"))
    model = [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d in range(2) for t in range(2)] \
        if stage == 3 else [f"mp_rank_{t:02d}_model_states.pt" for t in range(2)]
    assert set(model) | {f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(2) for t in range(2)} \
        <= names, sorted(names)
    for r in results:
        assert r["resumed"] == pytest.approx(r["straight"], rel=1e-6, abs=0)
        for key, ref, tol in (("loaded", "at_save", 0), ("whole_resumed", "whole", 1e-6)):
            for name, value in r[ref].items():
                torch.testing.assert_close(r[key][name], value, rtol=tol, atol=tol, msg=f"{key} {name}")
    consolidated = results[0]["consolidated"]
    assert set(consolidated) >= set(results[0]["at_save"])
    for name, value in results[0]["at_save"].items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0, msg=name)


def test_sp2_tp2_checkpoint_resumes_at_tp1(tmp_path):
    """sp 2 x tp 2 (ZeRO-1, AdamW) saved, loaded with a plain load_checkpoint at sp 2 x tp 1 on 2 ranks (the
    AutoTP slices re-sliced under ALST's sequence-parallel mpu, which has no tensor groups; before: refused
    as if it were a Megatron mpu): the whole weights loaded are the saved ones, and the 2 continued steps'
    losses equal the uninterrupted run's at sp 2 x tp 2 (the same math in another reduction order)."""
    import torch

    saved = run_distributed(4, sp_tp_resume, 1, str(tmp_path))[0]
    for r in run_distributed(2, sp_tp_load, 1, str(tmp_path), 1):
        for name, value in saved["at_save"].items():   # a load moves bytes: exact
            torch.testing.assert_close(r["loaded"][name], value, rtol=0, atol=0, msg=name)
        assert r["resumed"] == pytest.approx(saved["straight"], rel=1e-5), (r["resumed"], saved["straight"])


def test_heads_not_divisible_by_tp_times_sp_refused_on_every_rank():
    with pytest.raises(Exception, match=r"(?s)failed on 4/4 ranks.*head count 2 .* 2 x 2 = 4"):
        run_distributed(4, register_then_initialize, 2, 2, 2)


def test_autotp_with_another_client_mpu_still_refused():
    with pytest.raises(Exception, match=r"autotp_size=2 with a client `mpu`.*ALST's mpu"):
        run_distributed(2, autotp_with_own_mpu)
