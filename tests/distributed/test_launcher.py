"""The `deepspeed` launcher with real processes on CPU: env, failure propagation, signals.

Every test runs `sys.executable -m deepspeed.launcher.runner` (no PATH dependency) with an
explicit free --master_port, so parallel test sessions on one machine do not collide.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _env(**extra):
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def _launch(args, timeout=60, **kwargs):
    cmd = LAUNCHER + ["--master_port", str(_free_port())] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), **kwargs)


def _alive(pid: int) -> bool:
    """A pid counts as alive unless it is gone or a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_pids(path, count, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(p) for p in path.read_text().split()]
            if len(pids) >= count:
                return pids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"ranks did not report {count} pids")


ENV_SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CROSS_RANK", "CROSS_SIZE"]
# one write per line: ranks share the pipe unbuffered (python -u), and print() writes text and
# newline separately, so two ranks' lines could interleave
sys.stdout.write(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}) + "\\n")
print(f"rank {os.environ['RANK']} to stderr", file=sys.stderr)
"""


def test_two_ranks_get_env_and_local_rank_and_rank_logs(tmp_path):
    script = _script(tmp_path, "env.py", ENV_SCRIPT)
    logs = tmp_path / "logs"
    result = _launch(["--num_gpus", "2", "--enable_each_rank_log", str(logs), script, "--x", "1"])
    assert result.returncode == 0, result.stderr
    records = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["env"]["RANK"])
    for rank, record in enumerate(records):
        env = record["env"]
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        assert [env[k] for k in keys] == [str(rank), str(rank), "2", "2"]
        assert (env["MASTER_ADDR"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("127.0.0.1", "0", "1")
        assert record["argv"] == [f"--local_rank={rank}", "--x", "1"]
        log = (logs / f"rank{rank}.log").read_text()  # tee: in the log *and* on the console
        assert f'"RANK": "{rank}"' in log and f"rank {rank} to stderr" in log
        assert f"rank {rank} to stderr" in result.stderr
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]


def test_module_and_no_local_rank_and_no_python(tmp_path):
    _script(tmp_path, "mymod.py", "import sys; print('module argv', sys.argv[1:])\n")
    result = _launch(["--module", "--no_local_rank", "mymod", "a"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module argv ['a']"
    exe = _script(tmp_path, "run.sh", "#!/bin/sh\necho \"direct $RANK $@\"\n")
    os.chmod(exe, 0o755)
    result = _launch(["--no_python", "--num_gpus", "2", exe, "b"])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["direct 0 --local_rank=0 b", "direct 1 --local_rank=1 b"]


FAIL_SCRIPT = """
import os, sys, time
pids = sys.argv[-1]
if os.environ["RANK"] == "0":
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(60)
while not os.path.exists(pids):  # fail only once rank 0 is certainly running
    time.sleep(0.02)
print("Traceback (most recent call last):", file=sys.stderr)
print("RuntimeError: rank one exploded", file=sys.stderr)
raise SystemExit(7)
"""


def test_failing_rank_stops_the_job_with_its_exit_code_and_tail(tmp_path):
    script = _script(tmp_path, "fail.py", FAIL_SCRIPT)
    pids = tmp_path / "pids"
    start = time.monotonic()
    result = _launch(["--num_gpus", "2", "--no_local_rank", script, str(pids)], timeout=30)
    assert result.returncode == 7, result.stderr
    assert time.monotonic() - start < 10
    report = result.stderr.split("stopping the other", 1)
    assert "rank 1 (local_rank 1" in report[0] and "exited with code 7" in report[0]
    assert "last 20 lines of rank 1 stderr" in report[1] and "RuntimeError: rank one exploded" in report[1]
    (rank0_pid,) = [int(p) for p in pids.read_text().split()]
    assert not _alive(rank0_pid)


DRAIN_SCRIPT = """
import os, sys, time
marker = sys.argv[-1]
if os.environ["RANK"] == "1":
    open(marker, "w").close()
    raise SystemExit(3)
while not os.path.exists(marker):
    time.sleep(0.01)
time.sleep(0.3)   # rank 1 is gone by now: rank 0 writes its own account of the failure
print("rank 0 report: why the job failed", file=sys.stderr, flush=True)
raise SystemExit(1)
"""


def test_other_ranks_finish_their_reports_before_being_stopped(tmp_path):
    """[Note: launcher guarantees] 2: after the first failure the others get DS_LAUNCHER_DRAIN_SECONDS
    (1 s) to end by themselves, so a rank that diagnosed the same failure is heard (without the drain,
    rank 0 got SIGTERM while it was still writing)."""
    script = _script(tmp_path, "drain.py", DRAIN_SCRIPT)
    result = _launch(["--num_gpus", "2", "--no_local_rank", script, str(tmp_path / "marker")], timeout=30)
    assert result.returncode == 3, result.stderr
    assert "rank 0 report: why the job failed" in result.stderr, result.stderr


TREE_SCRIPT = """
import os, signal, subprocess, sys, time
ignore = sys.argv[-2] == "ignore-term"
child = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)" if ignore
         else "import time; time.sleep(60)")
grandchild = subprocess.Popen([sys.executable, "-c", child])
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[-1], "a") as f:
    f.write(f"{os.getpid()} {grandchild.pid}\\n")
if ignore and os.environ["RANK"] == "1":
    while len(open(sys.argv[-1]).read().split()) < 4:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _tree_cmd(script, mode, pids_file):
    port = str(_free_port())
    return LAUNCHER + ["--master_port", port, "--num_gpus", "2", "--no_local_rank", script, mode, str(pids_file)]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_kills_ranks_and_grandchildren(tmp_path, signum, code):
    script = _script(tmp_path, "tree.py", TREE_SCRIPT)
    pids_file = tmp_path / "pids"
    proc = subprocess.Popen(
        _tree_cmd(script, "plain", pids_file), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    pids = _wait_for_pids(pids_file, 4, proc)
    start = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == code, stderr
    assert f"received {signal.Signals(signum).name}" in stderr
    deadline = start + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def test_sigterm_ignoring_tree_is_sigkilled_after_grace(tmp_path):
    """Rank 1 dies by SIGKILL; rank 0 and both grandchildren ignore SIGTERM and need SIGKILL."""
    script = _script(tmp_path, "tree.py", TREE_SCRIPT)
    pids_file = tmp_path / "pids"
    cmd = _tree_cmd(script, "ignore-term", pids_file)
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_env(DS_LAUNCHER_GRACE_SECONDS="1"))
    assert result.returncode == 137, result.stderr
    assert "rank 1 (local_rank 1" in result.stderr and "killed by SIGKILL" in result.stderr
    assert time.monotonic() - start < 15
    assert [p for p in (int(p) for p in pids_file.read_text().split()) if _alive(p)] == []


GLOO_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # everything from the launcher's env
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
import sys
sys.stdout.write(f"rank {dist.get_rank()}/{dist.get_world_size()} sum {t.item()}\\n")  # one write: no interleaving
dist.destroy_process_group()
"""


def test_gloo_all_reduce_through_launcher(tmp_path):
    script = _script(tmp_path, "gloo.py", GLOO_SCRIPT)
    result = _launch(["--num_gpus", "2", "--no_local_rank", script], timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["rank 0/2 sum 3.0", "rank 1/2 sum 3.0"]


def test_ds_report_prints_versions():
    from importlib.metadata import version

    from deepspeed.version import __version__

    result = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"torch version ..................... {version('torch')}" in result.stdout
    assert __version__ in result.stdout
    assert "gloo: yes" in result.stdout and "data parallel" in result.stdout
