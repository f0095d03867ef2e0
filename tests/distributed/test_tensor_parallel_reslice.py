"""Resuming an AutoTP checkpoint at another tensor-parallel size ([Note: moving a checkpoint across TP
sizes] in runtime/checkpoint/tp_reslice.py): train at TP=t, save, resume in fresh processes at TP=t'
(another data size too); the continued training equals the uninterrupted run (fp32, ~1e-6: the row
layers' partial sums are added in another order). Same global batch on both sides: micro x dp fixed."""

from __future__ import annotations

import pytest

from harness import run_distributed
from models import assert_params_close
from tp_engine_jobs import reference, train_tp

STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["mlp", "glu"])
def test_sgd_momentum_tp2_to_tp1(tmp_path, stage, kind):
    """TP=2 x DP=1 -> TP=1 x DP=2 (momentum buffers moved; glu: a fused [gate; up] weight, block by block)."""
    ref = reference(kind, 3, dp=1, micro=2, lr=0.5, clip=0.0, momentum=0.9)
    run_distributed(2, train_tp, kind, 2, 2, stage, micro=2, momentum=0.9, save_dir=str(tmp_path))
    assert_params_close(run_distributed(2, train_tp, kind, 1, 1, stage, micro=1, momentum=0.9,
                                        load_dir=str(tmp_path), start=2), ref)


def _adamw_moved(tmp_path, tp_from: int, stage_from: int, tp_to: int, stage_to: int, **load) -> tuple[list, dict]:
    """AdamW on 2 ranks (micro = tp: a global batch of 2 rows either way): (2 steps at TP=`tp_from`, saved,
    then 1 step resumed at TP=`tp_to`; 3 uninterrupted steps at TP=`tp_to`)."""
    want = run_distributed(2, train_tp, "glu", 3, tp_to, stage_to, micro=tp_to, lr=0.01, adam=True)
    run_distributed(2, train_tp, "glu", 2, tp_from, stage_from, micro=tp_from, lr=0.01, adam=True,
                    save_dir=str(tmp_path))
    got = run_distributed(2, train_tp, "glu", 1, tp_to, stage_to, micro=tp_to, lr=0.01, adam=True,
                          load_dir=str(tmp_path), start=2, **load)
    return got, want[0]


@pytest.mark.parametrize("stage", STAGES)
def test_adamw_tp2_to_tp1(tmp_path, stage):
    """AdamW: both moments and the step count move; equals 3 uninterrupted steps at TP=1 x DP=2."""
    assert_params_close(*_adamw_moved(tmp_path, 2, stage, 1, stage))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_adamw_tp1_to_tp2(tmp_path, stage):
    """TP=1 x DP=2 -> TP=2 x DP=1: each tensor rank cuts its slices (and their moments) from the whole values."""
    assert_params_close(*_adamw_moved(tmp_path, 1, stage, 2, stage))


def test_dropped_moments_would_be_caught(tmp_path):
    """The comparison above is sensitive to the optimizer state: resuming the same TP=2 checkpoint at TP=1
    without it (load_optimizer_states=False: fresh moments, step 0) does not match."""
    got, want = _adamw_moved(tmp_path, 2, 1, 1, 1, load_kwargs={"load_optimizer_states": False})
    with pytest.raises(AssertionError):
        assert_params_close(got, want)


@pytest.mark.parametrize("stage", [0, 2])
def test_adam_state_after_the_move_equals_the_target_runs(tmp_path, stage):
    """Right after a TP=2 checkpoint loads at TP=1, every piece's exp_avg, exp_avg_sq and step equal those of
    the same 2 steps run at TP=1 (a dropped or mis-cut moment shows here, before any step)."""
    import torch

    want = run_distributed(2, train_tp, "glu", 2, 1, stage, micro=1, lr=0.01, adam=True, report_state=True)
    run_distributed(2, train_tp, "glu", 2, 2, stage, micro=2, lr=0.01, adam=True, save_dir=str(tmp_path))
    got = run_distributed(2, train_tp, "glu", 0, 1, stage, micro=1, lr=0.01, adam=True, load_dir=str(tmp_path),
                          start=2, report_state=True)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g["state"]) == sorted(w["state"]) and w["state"], rank
        for key, fields in w["state"].items():
            assert sorted(g["state"][key]) == sorted(fields) == ["exp_avg", "exp_avg_sq", "step"], key
            for name, value in fields.items():
                torch.testing.assert_close(torch.as_tensor(g["state"][key][name]), torch.as_tensor(value),
                                           rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {rank} {key} {name}: {m}")


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_dp2_to_tp1_dp4_and_tp4_dp1(tmp_path, stage, tp):
    """4 ranks: TP=2 x DP=2 -> TP=1 x DP=4 (one tensor rank's files serve no one alone) and -> TP=4 x DP=1
    (each new slice is half a saved one, fused blocks cut block by block); SGD momentum."""
    ref = reference("glu", 3, dp=2, micro=2, lr=0.5, clip=0.0, momentum=0.9)
    run_distributed(4, train_tp, "glu", 2, 2, stage, micro=2, momentum=0.9, save_dir=str(tmp_path))
    assert_params_close(run_distributed(4, train_tp, "glu", 1, tp, stage, micro=tp, momentum=0.9,
                                        load_dir=str(tmp_path), start=2), ref)


def test_tp_and_stage_change_together(tmp_path):
    """TP=2 at ZeRO-1 -> TP=1 at ZeRO-3 (the stage and the TP size change in one load); AdamW."""
    assert_params_close(*_adamw_moved(tmp_path, 2, 1, 1, 3))


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("tp_from,tp_to", [(2, 1), (1, 2)])
def test_frozen_sliced_weight_moves(tmp_path, stage, tp_from, tp_to):
    """A frozen row-parallel weight (read from the module state, or ZeRO-3's frozen fragments, not the
    optimizer's masters) is joined and cut like a trained one; SGD momentum for the rest."""
    run = dict(momentum=0.9, freeze="block.down.weight")
    want = run_distributed(2, train_tp, "mlp", 3, tp_to, stage, micro=tp_to, **run)
    run_distributed(2, train_tp, "mlp", 2, tp_from, stage, micro=tp_from, save_dir=str(tmp_path), **run)
    got = run_distributed(2, train_tp, "mlp", 1, tp_to, stage, micro=tp_to, load_dir=str(tmp_path), start=2, **run)
    assert_params_close(got, want[0])


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_tp2_to_tp1(tmp_path, stage):
    """bf16 (fp32 masters), SGD momentum: right after the move the TP=1 weights equal the TP=2 run's whole
    weights exactly, and one more step stays near the uninterrupted TP=1 run (bf16 sums in another order)."""
    run = dict(lr=0.1, momentum=0.9, extra={"bf16": {"enabled": True}})
    saved = run_distributed(2, train_tp, "glu", 2, 2, stage, micro=2, save_dir=str(tmp_path), **run)[0]
    moved = run_distributed(2, train_tp, "glu", 0, 1, stage, micro=1, load_dir=str(tmp_path), start=2, **run)
    assert_params_close(moved, saved, rtol=0, atol=0)
    want = run_distributed(2, train_tp, "glu", 3, 1, stage, micro=1, **run)[0]
    got = run_distributed(2, train_tp, "glu", 1, 1, stage, micro=1, load_dir=str(tmp_path), start=2, **run)
    assert_params_close(got, want, rtol=2e-2, atol=2e-3)


def test_another_partitioning_refused_on_every_rank(tmp_path):
    """Saved at TP=2 with gate_up fused ([2, -1] blocks), loaded at TP=4 by the automatic rule (one block):
    the slices cannot be moved; every rank raises, naming both sizes."""
    run_distributed(4, train_tp, "glu", 1, 2, 1, micro=2, save_dir=str(tmp_path))
    with pytest.raises(Exception, match="saved at tensor-parallel size 2 with another partitioning than this "
                                        "run's \\(autotp_size 4\\)"):
        run_distributed(4, train_tp, "glu", 1, 4, 1, micro=4, load_dir=str(tmp_path),
                        extra={"tensor_parallel": {"autotp_size": 4}})
