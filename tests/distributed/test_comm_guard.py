"""Rank-divergent programs are named, through the launcher (deepspeed/comm/guard.py,
[Note: collective guard]; deepspeed/launcher/launch.py, [Note: launcher guarantees] 2).

Each divergent job runs the real `deepspeed` launcher with 2 gloo ranks and a 1 s guard: rank 1
skips or repeats a backward, skips a step or runs another number of micro-batches. Before the
guard these hung for the backend's timeout (ZeRO-0/1/2) or ended in gloo's "Connection closed
by peer ... GLHF!" with the diagnosis killed by the launcher (ZeRO-3). Now the job exits
non-zero within seconds and the launcher's output names, for both ranks, the collective (number,
operation, issuing function or ZeRO-3 unit) each one waits in, or that a rank exited first.
The normal path is checked not to report a rank that is merely slow."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from harness import run_distributed

from deepspeed import comm as ds_comm
from deepspeed.comm import guard

JOB = os.path.join(os.path.dirname(__file__), "launcher_jobs", "diverge.py")
GUARD_S = "1"
BOUND_S = 60       # start-up of two ranks on a loaded 2-core machine, plus detection (~2 s)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(stage: int, case: str, guard_s: str = GUARD_S, zero3_s: str = "30") -> tuple[subprocess.CompletedProcess,
                                                                                         float]:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(_free_port()),
           "--num_gpus", "2", JOB, "--stage", str(stage), "--case", case]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", guard.GUARD_ENV: guard_s, "DEEPSPEED_ZERO3_TIMEOUT_S": zero3_s,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND_S + 30, env=env)
    return result, time.monotonic() - start


# rank -> (what it waits in | that it exited) per case, as every stage shows it; the operation of
# each side is asserted, and where the step's collectives are involved, their issuing function
_STEP = r"all_reduce of 1 float32 element issued in (check_zero_layout|clip_sharded_grads)"
_REDUCE = r"(reduce_scatter_tensor|all_reduce) of \d+ float32 elements(, the gradient reduce-scatter of module .*?,)? " \
          r"issued in \S+"
_CASES = {
    "skip_backward": {1: _STEP, 0: _REDUCE},
    "extra_backward": {0: _STEP, 1: _REDUCE},
    "skip_step": {0: _STEP, 1: _REDUCE},
    "micro_batches": {1: _REDUCE, 0: None},    # rank 0 finished its loop and exited
}
# ZeRO-0/1 reduce at the accumulation boundary only: a skipped step shifts rank 1's boundaries, so
# it finishes first (a skipped backward, or a third micro-batch, changes no collective there: the
# result differs silently, which no collective check can see).
_LOW_STAGES = {"skip_step": {0: _REDUCE, 1: None}}


_JOBS = [(2, c) for c in _CASES] + [(3, c) for c in _CASES] + [(0, "skip_step"), (1, "skip_step")]


@pytest.fixture(scope="module")
def launched(request):
    """The selected jobs, started a few at a time: most of a job's time is start-up and waiting
    (detection, the launcher's drain), which overlap; each test then waits for its own."""
    wanted = [tuple(item.callspec.params.values()) for item in request.session.items
              if getattr(item, "originalname", None) == "test_divergent_rank_is_named_through_the_launcher"]
    pool = ThreadPoolExecutor(max_workers=3)
    yield {job: pool.submit(_launch, *job) for job in wanted}
    pool.shutdown(wait=True)


@pytest.mark.parametrize("stage,case", _JOBS)
def test_divergent_rank_is_named_through_the_launcher(launched, stage: int, case: str) -> None:
    result, elapsed = launched[(stage, case)].result()
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-6000:]
    assert elapsed < BOUND_S, (elapsed, out[-6000:])
    # what the launcher shows as the failing rank's last lines carries the whole diagnosis
    tail = out.split("last 20 lines of rank", 1)[-1]
    assert "CollectiveDivergenceError" in tail and "diverged" in tail, out[-6000:]
    expected = _CASES[case] if stage >= 2 else _LOW_STAGES[case]
    for rank, what in expected.items():
        if what is None:
            assert re.search(rf"rank {rank}: exited after its collective #\d+, the ", tail), tail
            assert f"DONE rank {rank}" in out
        else:
            assert re.search(rf"rank {rank}: waits [\d.]+ s in collective #\d+, {what}", tail), tail
    assert "engine.backward() or engine.step()" in tail
    if None not in expected.values():
        assert "DONE" not in out, out[-3000:]


def test_zero3_deadline_first_reaches_the_rank_in_the_norm_all_reduce() -> None:
    """Issue 31 B.6 as filed: ZeRO-3's unit deadline (3 s) fires before the guard (30 s). gloo closes
    the connections as the reduce-scatter times out, so rank 1, in the gradient-norm all-reduce, fails
    before rank 0 has written why; it waits for rank 0's ZeRO-3 report and raises with it."""
    result, elapsed = _launch(3, "skip_backward", guard_s="30", zero3_s="3")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and elapsed < BOUND_S, out[-6000:]
    tail = out.split("last 20 lines of rank", 1)[-1]
    assert re.search(r"rank 1: this rank waits in collective #\d+ of group '\w+', " + _STEP + r".*, while rank 0: "
                     r"ZeRO-3: the collective failed .*the gradient reduce-scatter of module", tail), out[-6000:]
    assert "GLHF" not in tail.split("CollectiveDivergenceError", 1)[-1]


def test_passing_job_is_unchanged() -> None:
    result, _ = _launch(2, "none")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "DONE rank 0" in result.stdout and "DONE rank 1" in result.stdout


# --- in-process: a slow rank is not a divergence ----------------------------------------------------
def slow_rank(stuck_s: float, sleep_s: float) -> dict:
    previous = guard.configure(stuck_s=stuck_s)
    try:
        book = guard.ledger(None)
        first = book.seq
        t = torch.ones(4)
        for i in range(3):
            if ds_comm.get_rank() == 1 and i == 1:
                time.sleep(sleep_s)       # rank 0 waits in its all_reduce meanwhile, 4 ticks and more
            ds_comm.all_reduce(t)
        try:
            ds_comm.all_reduce(t, op="not an op")   # raises on this rank alone, before any traffic
        except Exception as exc:
            refused = type(exc).__name__
        work = ds_comm.all_reduce(t, async_op=True)
        wrapped = isinstance(work, guard.GuardedWork)
        work.wait()
        return {"issued": book.seq - first, "value": t[0].item(), "failure": book.failure, "wrapped": wrapped,
                "pending": book.oldest_pending() is not None, "refused": refused}
    finally:
        guard.configure(**vars(previous))


def test_a_slow_rank_is_not_reported() -> None:
    """Rank 1 computes for 1.5 s while rank 0 waits in an all-reduce (guard at 0.2 s): no report."""
    for r in run_distributed(2, slow_rank, 0.2, 1.5):
        # the refused call is journaled and done (not waited in forever); the sums are right
        assert r == {"issued": 5, "value": 16.0, "failure": None, "wrapped": True, "pending": False,
                     "refused": r["refused"]}, r
