"""Ulysses sequence parallelism (ALST) driven unchanged by Hugging Face Trainer and Accelerate, 2 ranks
on CPU forming one SP group: transformers' `deepspeed_sp_compute_loss`, accelerate's `_prepare_deepspeed`
SP branch (register_with_transformers, the mpu, UlyssesSPDataLoaderAdapter) and axolotl's TiledMLP call
pattern, each against one process training the same tiny Llama on the full sequences: per-step loss,
gradient norm and the weights after SGD agree to fp32 rounding (hf_sp_worker.py says why world 2).
With AutoTP (`tensor_parallel.autotp_size` in the DeepSpeed config) beside the SP ParallelismConfig:
4 ranks = sp 2 x tp 2, the same checks against the same single process."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_clients import run_under_deepspeed_launcher  # noqa: E402


def test_trainer_and_accelerate_ulysses_sp_match_full_sequence(tmp_path):
    variants = ["trainer-z2", "trainer-z3", "trainer-z3-tiled", "accelerate-z1"]
    _check_trained(run_under_deepspeed_launcher("hf_sp_worker.py", tmp_path, variants))


def _check_trained(result: dict) -> None:
    for name, r in result.items():
        before, after = r["dataset_loss"]
        assert len(r["losses"]) == 8 and after < 0.98 * before, (name, r)


def test_accelerate_sp2_x_autotp2_on_4_ranks_matches_one_process(tmp_path):
    """Accelerate's order: the SP loader adapter is made before deepspeed.initialize refines the mesh
    with the tensor dim, and its train_batch_size counts data-parallel replicas only."""
    _check_trained(run_under_deepspeed_launcher("hf_sp_worker.py", tmp_path, ["accelerate-z1-tp2"], ranks=4))


@pytest.mark.slow
def test_trainer_sp2_x_autotp2_zero2_zero3_on_4_ranks(tmp_path):
    """Trainer's order: its tp_model_init shards the model before accelerate registers ALST."""
    _check_trained(run_under_deepspeed_launcher("hf_sp_worker.py", tmp_path, ["trainer-z2-tp2", "trainer-z3-tp2"],
                                                ranks=4))
