"""load_module_strict=False as DeepSpeed, failures only one rank sees raised on every rank (no hang),
and background saves (checkpoint.async_save). Jobs live in ckpt_fault_jobs.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckpt_fault_jobs as F
import ckpt_jobs as J
from harness import run_distributed

BOUND_S = 60  # a hang would be the gloo timeout (90 s here) or the arrival timeout (300 s)


def _cfg(stage: int, world: int = 2, **extra) -> dict:
    return J.config(stage, world, scheduler=False, **extra)


# --- load_module_strict=False ---------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("saved, loading", [("tiny", "tiny_extra"), ("tiny_extra", "tiny")],
                         ids=["model_has_extra", "checkpoint_has_extra"])
def test_non_strict_load(tmp_path, stage, saved, loading):
    a = run_distributed(2, J.save_job, _cfg(stage), str(tmp_path), model=saved, post=0)[0]
    results = run_distributed(2, F.non_strict_load_job, _cfg(stage), str(tmp_path), loading, timeout=180)
    b = results[0]
    saved_module = a["state"]["module"]
    common = set(saved_module) & set(b["loaded"])
    assert common == set(saved_module) - {"extra"}
    for key in common:  # the common weights (and buffers) are the saved ones
        assert torch.equal(b["loaded"][key], saved_module[key]), key
    if loading == "tiny_extra":  # the parameter the checkpoint lacks keeps its initial value ...
        assert torch.equal(b["loaded"]["extra"], b["fresh"]["extra"])
        assert torch.equal(b["snap"]["extra"]["fp32"], b["fresh"]["extra"])  # ... and so does its fp32 master
        assert not torch.equal(b["fresh"]["fc1.weight"], saved_module["fc1.weight"])  # a real load happened
    for name, entry in b["snap"].items():  # masters equal the module's weights
        assert torch.equal(entry["fp32"], b["loaded"][name].float()), name
    # training goes on as plain torch from those weights with a fresh AdamW
    torch.testing.assert_close(torch.tensor(b["losses"], dtype=torch.float64),
                               torch.tensor(b["reference"], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert b["after"].keys() == b["loaded"].keys()


def test_strict_load_names_the_keys_on_every_rank(tmp_path):
    run_distributed(2, J.save_job, _cfg(1), str(tmp_path), post=0)
    for r in run_distributed(2, J.expect_error_job, _cfg(1), str(tmp_path), model="tiny_extra"):
        assert r["type"] == "CheckpointError", r
        assert "missing ['extra']" in r["message"] and "load_module_strict=True" in r["message"], r


# --- a fault only one rank sees: every rank raises, in bounded time --------------------------------
@pytest.fixture(scope="module")
def saved_stage1(tmp_path_factory):
    d = tmp_path_factory.mktemp("stage1")
    run_distributed(2, J.save_job, _cfg(1), str(d), post=0)
    return d


def _assert_agreed(results, victim, needle):
    for rank, r in enumerate(results):
        assert r["type"] == "CheckpointError", (rank, r)
        assert f"rank {victim}" in r["message"] and needle in r["message"], (rank, r["message"])
        assert r["elapsed"] < BOUND_S, (rank, r["elapsed"])
        assert list(r["failures"]) == [victim], r


def test_load_with_one_rank_file_corrupt_raises_on_every_rank(saved_stage1, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(saved_stage1, d)
    shutil.copytree(d / "global_step3", d / "good")
    rng = d / "global_step3" / "rng_state_1.pt"  # read by rank 1 only
    rng.write_bytes(rng.read_bytes()[:100])
    results = run_distributed(2, F.faulty_load_job, _cfg(1), str(d), "rng", 1, timeout=BOUND_S * 2)
    _assert_agreed(results, 1, "rng_state_1.pt")
    assert all(r["then"] for r in results)


def test_load_with_a_shard_lacking_a_key_on_one_rank_raises_on_every_rank(saved_stage1):
    results = run_distributed(2, F.faulty_load_job, _cfg(1), str(saved_stage1), "shard_lacks_key", 0,
                              timeout=BOUND_S * 2)
    _assert_agreed(results, 0, "head.bias")
    assert all(r["then"] for r in results)


def test_latest_seen_by_some_ranks_only_raises_on_every_rank(saved_stage1):
    """One rank finds no `latest` (a lagging file system): it must not return (None, None) while
    the others load and enter the re-gather."""
    results = run_distributed(2, F.faulty_load_job, _cfg(1), str(saved_stage1), "no_latest", 1, timeout=BOUND_S * 2)
    for r in results:
        assert r["type"] == "CheckpointError" and "ranks disagree" in r["message"], r
        assert r["elapsed"] < BOUND_S and r["then"], r


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_write_failure_on_one_rank_raises_on_every_rank(tmp_path, stage, background):
    cfg = _cfg(stage, checkpoint={"async_save": background})
    results = run_distributed(2, F.faulty_save_job, cfg, str(tmp_path), "write", 1, timeout=BOUND_S * 2)
    _assert_agreed(results, 1, "No space left on device")
    for r in results:  # the cause, the file and the bytes, said once ([Note: disk full])
        message = r["message"]
        assert message.startswith(f"save_checkpoint: writing {tmp_path}/bad"), message
        assert "failed failed" not in message and "unexpected pos" not in message, message
        assert f"rank 1: OSError: [Errno 28] No space left on device (the file needs " in message, message
        assert f"{tmp_path}/.bad.partial/" in message and "bytes free on that file system" in message, message
        assert r["latest"] == "good" and r["latest_after"] == "after", r
        assert r["listing"] == ["good", "latest", "zero_to_fp32.py"], r  # nothing of "bad", no staging left


@pytest.mark.parametrize("stage, background", [(2, False), (3, True)], ids=["zero2_exchange", "zero3_background"])
def test_nvme_streamed_write_failure_raises_on_every_rank(tmp_path, stage, background):
    """ZeRO-2 with NVMe optimizer offload at 2 ranks writes the optimizer file while the re-cut's
    all-to-all runs ([Note: streamed re-cut]): rank 1's full disk there must not leave rank 0 waiting
    in the exchange; ZeRO-3 with async_save streams it from the swap files in the background. Every
    rank raises naming the file, nothing of the tag is published."""
    (tmp_path / "swap").mkdir()
    cfg = _cfg(stage, checkpoint={"async_save": background})
    cfg["zero_optimization"].update(reduce_bucket_size=64, offload_optimizer={"device": "nvme",
                                                                              "nvme_path": str(tmp_path / "swap")})
    save_dir = tmp_path / "ckpt"
    results = run_distributed(2, F.faulty_save_job, cfg, str(save_dir), "write", 1, timeout=BOUND_S * 2)
    _assert_agreed(results, 1, "No space left on device")
    for r in results:
        assert f"{save_dir}/.bad.partial/zero_pp_rank_1_mp_rank_00_" in r["message"], r["message"]
        assert r["listing"] == ["good", "latest", "zero_to_fp32.py"], r   # no staging directory, no .tmp
        assert r["latest"] == "good" and r["latest_after"] == "after", r


def test_tag_bad_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_distributed(2, F.faulty_save_job, _cfg(2), str(tmp_path), "tag", 1, timeout=BOUND_S * 2)
    _assert_agreed(results, 1, "bad/tag")
    assert all(r["listing"] == ["good", "latest", "zero_to_fp32.py"] for r in results)


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_ranks_writing_the_same_file_are_refused_by_name(tmp_path, background):
    """A layout that gives two ranks the same file names (as SP x TP once did with mp_rank_00) is
    refused on every rank, naming the file and the ranks, before anything is written."""
    cfg = _cfg(2, checkpoint={"async_save": background})
    results = run_distributed(2, F.faulty_save_job, cfg, str(tmp_path), "clash", 0, timeout=BOUND_S * 2)
    for r in results:
        assert r["type"] == "CheckpointError", r
        assert "several ranks would write the same file" in r["message"], r
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt by ranks [0, 1]" in r["message"], r
        assert r["listing"] == ["good", "latest", "zero_to_fp32.py"] and r["latest_after"] == "after", r


def test_write_failure_on_one_of_four_ranks_raises_on_every_rank(tmp_path):
    results = run_distributed(4, F.faulty_save_job, _cfg(2, 4), str(tmp_path), "write", 2, timeout=BOUND_S * 3)
    _assert_agreed(results, 2, "No space left on device")
    assert all(r["latest"] == "good" and r["latest_after"] == "after" for r in results)


# --- background saves ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_background_save_holds_the_state_at_save_time(tmp_path, stage):
    cfg = _cfg(stage, checkpoint={"async_save": True})
    a = run_distributed(2, F.async_save_job, cfg, str(tmp_path))[0]
    assert a["latest"] == "second"
    assert a["listing"] == ["global_step3", "latest", "second", "zero_to_fp32.py"]
    b = run_distributed(2, J.load_job, _cfg(stage), str(tmp_path), tag="global_step3", train_after=False)[0]
    J.assert_snap_equal(a["snap"], b["snap"])
    assert b["state"]["global_steps"] == 3
    for key, value in a["state"]["module"].items():
        assert torch.equal(b["state"]["module"][key], value), key
    assert os.path.isfile(tmp_path / "second" / "rng_state_1.pt")


@pytest.mark.parametrize("stage", [2, 3])
def test_save_dir_renamed_while_the_background_write_runs(tmp_path, stage):
    """HF Trainer renames `tmp-checkpoint-N` to `checkpoint-N` right after save_checkpoint returns,
    then rotates old checkpoints: the background write goes on through its directory descriptors
    and publishes in the renamed directory; nothing is written under the old name."""
    results = run_distributed(2, F.renamed_while_writing_job, _cfg(stage, checkpoint={"async_save": True}),
                              str(tmp_path))
    a = results[0]
    assert all(r["running"] == [True, True] for r in results), results  # the renames really hit running writes
    assert a["root"] == ["checkpoint-2"], a["root"]
    assert a["listing"] == ["global_step2", "latest", "zero_to_fp32.py"] and a["latest"] == "global_step2", a
    b = run_distributed(2, J.load_job, _cfg(stage), str(tmp_path / "checkpoint-2"), train_after=False)[0]
    J.assert_snap_equal(a["snap"], b["snap"])
    assert b["state"]["global_steps"] == 2


def test_default_save_is_published_when_it_returns(tmp_path):
    """async_save false (the default): the tag and `latest` exist when save_checkpoint returns (a
    client may copy, load or rotate at once); only the fsyncs run afterwards, and renaming the
    save directory meanwhile changes nothing."""
    for r in run_distributed(2, F.published_on_return_job, _cfg(2), str(tmp_path)):
        assert r["kind"] == "make_durable", r
        assert r["listing"] == ["global_step1", "latest", "zero_to_fp32.py"], r
        assert r["after"] == r["listing"], r
