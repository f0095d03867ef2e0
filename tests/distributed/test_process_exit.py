"""Processes exit 0 after a successful run whether or not the script destroys the process group.

[Note: exiting without destroy_process_group] in deepspeed/comm/exit.py. Without the exit step
a 2-rank ZeRO-1/2 job that ends with an `all_reduce` and no teardown died now and then with
"terminate called without an active exception" (SIGABRT) after all its work was done. The
repeated runs are forked from one driver (exit_runs.py: no interpreter start-up per run) on
one core, with a long GIL switch interval that makes the race at exit likely.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "exit_runs.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env() -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def _drive(stage: int, runs: int, mode: str = "plain", cpu: int = 0, timeout: float = 240) -> list[dict]:
    cmd = [sys.executable, DRIVER, "--stage", str(stage), "--runs", str(runs), "--mode", mode, "--cpu", str(cpu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])["runs"]


def _failures(runs: list[dict], expected: list[int]) -> list[tuple[int, list]]:
    return [(i, run["codes"]) for i, run in enumerate(runs) if run["codes"] != expected]


def test_zero1_and_zero2_jobs_without_teardown_exit_0_20_times_each():
    """20 runs per stage, the two stages side by side (one core each)."""
    procs = {}
    for stage in (1, 2):
        cmd = [sys.executable, DRIVER, "--stage", str(stage), "--runs", "20", "--cpu", str(stage - 1)]
        procs[stage] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    failures = {}
    for stage, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (stage, proc.returncode, out[-3000:], err[-3000:])
        bad = _failures(json.loads(lines[-1][len("RESULT "):])["runs"], [0, 0])
        if bad:
            failures[stage] = (bad, [line for line in err.splitlines() if "terminate" in line][:3])
    assert not failures, f"runs that did not exit 0 (exit codes per rank; -6 is SIGABRT): {failures}"


def test_script_that_destroys_the_group_itself_exits_0():
    assert not _failures(_drive(2, 2, mode="destroy"), [0, 0])


def test_rank_failing_with_a_collective_pending_exits_at_once():
    """No barrier and no wait for the pending collective at exit: the failing rank leaves within
    seconds while its peer is still alive (10 s), with the exception's exit code."""
    (run,) = _drive(1, 1, mode="raise")
    assert run["codes"] == [0, 1], run
    assert run["seconds"][1] < 7, run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("stage", [2])
def test_launcher_reports_success_without_teardown(stage):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           DRIVER, "--single", "--stage", str(stage)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
