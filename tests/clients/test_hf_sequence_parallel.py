"""Ulysses sequence parallelism (ALST) driven unchanged by Hugging Face Trainer and Accelerate, 2 ranks
on CPU forming one SP group: transformers' `deepspeed_sp_compute_loss`, accelerate's `_prepare_deepspeed`
SP branch (register_with_transformers, the mpu, UlyssesSPDataLoaderAdapter) and axolotl's TiledMLP call
pattern, each against one process training the same tiny Llama on the full sequences: per-step loss,
gradient norm and the weights after SGD agree to fp32 rounding (hf_sp_worker.py says why world 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_clients import run_under_deepspeed_launcher  # noqa: E402


def test_trainer_and_accelerate_ulysses_sp_match_full_sequence(tmp_path):
    variants = ["trainer-z2", "trainer-z3", "trainer-z3-tiled", "accelerate-z1"]
    result = run_under_deepspeed_launcher("hf_sp_worker.py", tmp_path, variants)
    for name, r in result.items():
        before, after = r["dataset_loss"]
        assert len(r["losses"]) == 8 and after < 0.98 * before, (name, r)
