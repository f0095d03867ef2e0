"""A real SIGKILL in the middle of save_checkpoint (two ranks under the launcher), and the
recovery of a tag caught between the two renames of its commit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch

import ckpt_jobs as J
from ckpt_jobs import MODEL_FILE, assert_snap_equal, optim_file
from harness import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
COMPLETE = sorted([MODEL_FILE, optim_file(0), optim_file(1), "rng_state_0.pt", "rng_state_1.pt"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resume_and_save_job(cfg: dict, save_dir: str) -> dict:
    """Load `latest`, check the masters, train the next batch and save B again."""
    engine = J.build(cfg, seed=123)
    path, _ = engine.load_checkpoint(save_dir)
    snap = J.snapshot(engine)
    J.train(engine, J.batches(3)[2:])
    engine.save_checkpoint(save_dir, tag="B")
    return {"path": path, "snap": snap, "global_steps": engine.global_steps}


def _launch(tmp_path, mode: str):
    save_dir, record = tmp_path / "ckpt", tmp_path / "masters_at_A.pt"
    script = os.path.join(HERE, "ckpt_crash_script.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_LAUNCHER_GRACE_SECONDS": "2",
           "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(_free_port()),
           "--num_gpus", "2", "--no_local_rank", script, str(save_dir), str(record), mode]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    return save_dir, record, result, time.monotonic() - start


def _crash(tmp_path, mode: str):
    save_dir, record, result, elapsed = _launch(tmp_path, mode)
    assert result.returncode != 0, result.stderr[-3000:]
    victim = "rank 0" if mode == "publish" else "rank 1"
    assert "killed by SIGKILL" in result.stderr and victim in result.stderr, result.stderr[-3000:]
    assert elapsed < 150, elapsed
    return save_dir, record, result


def test_sigkill_while_saving_keeps_previous_checkpoint(tmp_path):
    """checkpoint.async_save false: the kill hits save_checkpoint itself."""
    save_dir, record, result = _crash(tmp_path, "sync")
    assert "save of B returned" not in result.stdout
    _check_previous_checkpoint_survives(save_dir, record)


def test_sigkill_during_background_write_keeps_previous_checkpoint(tmp_path):
    """The default background save: save_checkpoint(B) returned and training went on; rank 1's writer
    thread is killed mid-file. Rank 0 wrote all its files (and waits for rank 1's marker), but B
    is never published and `latest` still names A."""
    save_dir, record, result = _crash(tmp_path, "async")
    assert "rank 1: save of B returned" in result.stdout, result.stdout[-2000:]
    assert "background save of B finished" not in result.stdout
    staging = save_dir / ".B.partial"  # rank 0 finished its files and waited for rank 1's marker
    assert (staging / ".rank0.done").exists() and (staging / optim_file(0)).exists(), os.listdir(staging)
    assert not (staging / ".rank1.done").exists()
    _check_previous_checkpoint_survives(save_dir, record)


def test_sigkill_while_publishing_in_the_background_keeps_latest(tmp_path):
    """Rank 0's background thread dies after renaming B into place and before writing `latest`:
    `latest` still names A, which loads; B is complete (every file fsynced before the rename)."""
    save_dir, record, result = _crash(tmp_path, "publish")
    assert "rank 0: save of B returned" in result.stdout, result.stdout[-2000:]
    assert (save_dir / "latest").read_text() == "A"
    assert sorted(os.listdir(save_dir / "A")) == COMPLETE
    assert sorted(f for f in os.listdir(save_dir / "B") if not f.startswith(".")) == COMPLETE
    recorded = torch.load(record, weights_only=True)
    b = run_distributed(2, J.load_job, J.config(2, 2), str(save_dir), pre=2, post=1)[0]
    assert b["path"] == str(save_dir / "A" / MODEL_FILE) and b["state"]["global_steps"] == 2
    assert_snap_equal(recorded["snap"], b["snap"])


def test_exit_right_after_a_background_save_publishes_it(tmp_path):
    """The script ends while B's background write is still running (each file's write is slowed
    by 0.5 s): the process waits for it at exit, B is published and named by `latest`, the ranks
    exit 0, and B holds the state at its save."""
    save_dir, record, result, _ = _launch(tmp_path, "exit")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("save of B returned") == 2, result.stdout[-2000:]
    assert (save_dir / "latest").read_text() == "B"
    assert sorted(os.listdir(save_dir)) == ["A", "B", "latest", "zero_to_fp32.py"]
    assert sorted(os.listdir(save_dir / "B")) == COMPLETE
    recorded = torch.load(str(record) + ".B", weights_only=True)
    b = run_distributed(2, J.load_job, J.config(2, 2), str(save_dir), pre=3, post=0)[0]
    assert b["path"] == str(save_dir / "B" / MODEL_FILE)
    assert b["state"]["global_steps"] == recorded["global_steps"] == 3
    assert_snap_equal(recorded["snap"], b["snap"])


def test_failed_background_save_at_exit_fails_the_process(tmp_path):
    """A background save (async_save) whose write fails on one rank, with nothing but process exit
    left to wait for it: the run did not succeed (its last checkpoint is lost), so the failing rank
    exits non-zero with the cause, and the launcher reports the job failed; `latest` keeps A."""
    save_dir, _, result, _ = _launch(tmp_path, "exitfail")
    assert result.returncode != 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "background save_checkpoint of B" in out and "No space left on device" in out, out[-3000:]
    assert (save_dir / "latest").read_text() == "A"
    assert not (save_dir / "B").exists()


def _check_previous_checkpoint_survives(save_dir, record):
    # A is published and named by `latest`; B never became visible
    assert (save_dir / "latest").read_text() == "A"
    assert sorted(os.listdir(save_dir / "A")) == COMPLETE
    assert not (save_dir / "B").exists()
    staging = save_dir / ".B.partial"  # the crash really hit mid-write: a half file under the temporary name
    assert (staging / (optim_file(1) + ".tmp")).stat().st_size > 0
    assert not (staging / optim_file(1)).exists()

    recorded = torch.load(record, weights_only=True)
    for world, stage in ((1, 0), (2, 1)):
        loaded = run_distributed(world, J.load_job, J.config(stage, world), str(save_dir), pre=2, post=1)
        b = loaded[0]
        assert [r["path"] for r in loaded] == [str(save_dir / "A" / MODEL_FILE)] * world
        assert b["state"]["global_steps"] == recorded["global_steps"] == 2
        assert_snap_equal(recorded["snap"], b["snap"])
    # a later save of the same tag cleans up the crashed attempt
    r = run_distributed(2, resume_and_save_job, J.config(2, 2), str(save_dir))[0]
    assert_snap_equal(recorded["snap"], r["snap"])
    assert r["global_steps"] == 3
    assert (save_dir / "latest").read_text() == "B"
    assert sorted(os.listdir(save_dir / "B")) == COMPLETE
    assert sorted(os.listdir(save_dir)) == ["A", "B", "latest", "zero_to_fp32.py"]


def test_tag_between_commit_renames_is_recovered(tmp_path):
    """A crash between `<tag>` -> `.<tag>.old` and `.<tag>.partial` -> `<tag>` (re-saving a tag)
    leaves only `.<tag>.old`: loads must still find it, and the next save must repair it."""
    d = str(tmp_path)
    a = run_distributed(2, J.save_job, J.config(2, 2), d, tag="T", pre=2, post=0)[0]
    os.rename(tmp_path / "T", tmp_path / ".T.old")
    for tag in (None, "T"):
        b = run_distributed(1, J.load_job, J.config(0, 1), d, tag=tag, pre=2, post=1)[0]
        assert_snap_equal(a["snap"], b["snap"])
        assert b["state"]["global_steps"] == 2
    run_distributed(2, J.save_job, J.config(2, 2), d, tag="T", pre=3, post=0)
    assert sorted(os.listdir(tmp_path)) == ["T", "latest", "zero_to_fp32.py"]
    b = run_distributed(2, J.load_job, J.config(2, 2), d, pre=3, post=0)[0]
    assert b["state"]["global_steps"] == 3
