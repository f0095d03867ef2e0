"""Multi-node command lines against DeepSpeed 0.19.8's, recorded in tests/fixtures/launcher_0_19_8.

Each fixture case is a hostfile, `deepspeed` flags, an environment and .deepspeed_env files, with
the command upstream's runner.main would start (or the error it raises). Here the same inputs go
through `runner.decide` -> `multinode.make_runner` -> `multinode.build_backend_job`, with
sys.executable, the working directory, the pid and `hostname -I` pinned to the fixture's values.
Upstream's commands that cannot work are listed in DEVIATIONS with the change we make.
tools/launcher_fixtures.py regenerates the fixtures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

import pytest

from deepspeed.launcher import multinode, multinode_runner, runner
from deepspeed.launcher.constants import MVAPICH_TMP_HOSTFILE
from deepspeed.launcher.plan import LaunchError, LocalHost, NodeJob, decode_world_info

FIXTURES = Path(__file__).parents[1] / "fixtures" / "launcher_0_19_8"
RUNNER = json.loads((FIXTURES / "runner_cmds.json").read_text())
PDSH = json.loads((FIXTURES / "pdsh_get_cmd.json").read_text())
META = RUNNER["meta"]
PY, CWD, HOME = "{PYTHON}", "/fixture/cwd", "/fixture/home"
LAUNCHER_DIR = os.path.dirname(os.path.realpath(multinode_runner.__file__))


def _helper_index(cmd):
    return next(i for i, part in enumerate(cmd) if part.endswith("launcher_helper.py"))


def _mpich_module(cmd):  # upstream: python -u -m <helper path> (cannot run); here: python -u <helper>
    i = _helper_index(cmd)
    return cmd[:i - 1] + cmd[i:]


def _mpich_no_python(cmd):  # upstream executes the helper file itself (no shebang); here: python -u <helper>
    i = _helper_index(cmd)
    return cmd[:i] + [PY, "-u"] + cmd[i:]


DEVIATIONS = {
    "pdsh_user_args_quoting": lambda cmd: cmd[:-1] + [shlex.quote("x'y")],  # upstream: x'y unquoted
    "mpich_module_args": _mpich_module,
    "mpich_no_python": _mpich_no_python,
    "slurm_module": lambda cmd: cmd[:-1] + ["-m", cmd[-1]],  # upstream ignores --module
    "slurm_no_python": lambda cmd: cmd[:-3] + [cmd[-1]],  # upstream ignores --no_python
}
# Upstream starts these on one host locally after `ssh HOST hostname -I`; here one host needs no ssh
# and the master address stays 127.0.0.1 (or --master_addr).
LOCAL_WITHOUT_SSH = {"openmpi_include_error"}


def _inputs(case):
    argv = [a.replace("{CWD}", CWD) for a in case["argv"]]  # a path the shell quoting leaves alone
    args = runner.parse_args(argv)
    env = {"PATH": "/usr/bin:/bin", "HOME": HOME, **case["env"]}
    files = []
    if case["home_ds_env"]:
        files.append((f"{HOME}/.deepspeed_env", case["home_ds_env"]))
    if case["ds_env"]:
        files.append((f"{CWD}/.deepspeed_env", case["ds_env"]))
    cuda = case["accelerator"] == "cuda"
    host = LocalHost(visible_devices=None, cpus=tuple(range(8)))
    return args, env, files, cuda, host, case["hostfile"].splitlines()


def _run(case, tmp_path):
    """What this implementation does with the case's inputs: ('cmd', cmd, env, ssh) / ('local', job) / error."""
    args, env, files, cuda, host, lines = _inputs(case)
    decision = runner.decide(args, host, lines, python=PY, env=env)
    if isinstance(decision, NodeJob):
        return ("local", decision, args)
    first = next(iter(decision.active))
    pinned = dict(python=PY, cwd=CWD, launcher_pid=META["pid"])
    if args.launcher == "mvapich":
        pinned["cuda"] = cuda
    backend = multinode.make_runner(args, decision.active, decision.pool, **pinned)
    if isinstance(backend, multinode_runner.IMPIRunner):
        backend.numa_cores = META["numa_cores"]
    if isinstance(backend, multinode_runner.MVAPICHRunner):
        multinode_runner.MVAPICH_TMP_HOSTFILE = str(tmp_path / "mvapich_hostfile")
    ssh = []
    if not args.no_ssh_check:
        ssh.append(multinode.ssh_check_cmd(first, args.ssh_port))
    if not args.master_addr:
        ssh.append(multinode.hostname_cmd(first, args.ssh_port))
        args.master_addr = META["hostname_I"].split()[0]
    args.master_port = args.master_port or 29500
    job = multinode.build_backend_job(backend, decision.active, env, files, ["NCCL"] if cuda else [])
    cmd = [_normalize(part, tmp_path) for part in job.cmd]
    hostfile = (tmp_path / "mvapich_hostfile").read_text() if (tmp_path / "mvapich_hostfile").exists() else None
    env = {k: _normalize(job.env[k], tmp_path) for k in ("PDSH_RCMD_TYPE", "PDSH_SSH_ARGS_APPEND", "PYTHONPATH")
           if k in job.env}
    return ("cmd", cmd, env, ssh, hostfile)


def _normalize(text, tmp_path):
    text = text.replace(LAUNCHER_DIR, "{LAUNCHER_DIR}").replace(CWD, "{CWD}").replace(str(META["pid"]), "{PID}")
    return text.replace(str(tmp_path / "mvapich_hostfile"), MVAPICH_TMP_HOSTFILE)


@pytest.fixture(autouse=True)
def _restore_mvapich_path():
    saved = multinode_runner.MVAPICH_TMP_HOSTFILE
    yield
    multinode_runner.MVAPICH_TMP_HOSTFILE = saved


def _upstream_launch_args(cmd):
    parser = argparse.ArgumentParser()
    for flag in ("--world_info", "--master_addr", "--master_port", "--node_rank", "--enable_each_rank_log",
                 "--bind_core_list", "--log_level"):
        parser.add_argument(flag)
    for flag in ("--no_local_rank", "--bind_cores_to_rank", "--module", "--no_python", "--quiet"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    start = cmd.index("deepspeed.launcher.launch") + 1
    return parser.parse_args(cmd[start:])


@pytest.mark.parametrize("case", RUNNER["cases"], ids=[c["name"] for c in RUNNER["cases"]])
def test_runner_matches_upstream(case, tmp_path):
    if "error" in case:
        with pytest.raises(LaunchError):
            _run(case, tmp_path)
        return
    outcome = _run(case, tmp_path)
    upstream_cmd = case["cmd"]
    if upstream_cmd[0] == PY and upstream_cmd[3] == "deepspeed.launcher.launch":
        # upstream starts one node's launch.py locally; we run the same plan in-process
        kind, job, args = outcome
        assert kind == "local"
        up = _upstream_launch_args(upstream_cmd)
        world = decode_world_info(up.world_info)
        assert job.hosts == tuple(world) and job.devices == tuple(tuple(ids) for ids in world.values())
        assert job.node_rank == int(up.node_rank or 0)
        expected_addr = "127.0.0.1" if case["name"] in LOCAL_WITHOUT_SSH else up.master_addr
        assert job.master == (expected_addr, int(up.master_port))
        assert job.spec.no_local_rank == up.no_local_rank and job.spec.script == up.rest[0]
        assert list(job.spec.args) == up.rest[1:]
        assert job.log_dir == (None if up.enable_each_rank_log == "None" else up.enable_each_rank_log)
        if up.bind_cores_to_rank:
            assert job.cores == tuple(range(4)) and up.bind_core_list == "0-3"
        assert (job.link is None) == (len(world) == 1)
        return
    kind, cmd, env, ssh, hostfile = outcome
    expected = DEVIATIONS.get(case["name"], lambda c: c)(upstream_cmd)
    assert cmd == expected
    assert env == case["popen_env"]
    assert ssh == case["ssh_calls"]
    if "mvapich_hostfile" in case:
        assert hostfile == case["mvapich_hostfile"]


def test_every_runner_and_deviation_is_covered():
    names = {c["name"] for c in RUNNER["cases"]}
    for prefix in ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm", "no_ssh"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert set(DEVIATIONS) <= names and LOCAL_WITHOUT_SSH <= names


@pytest.mark.parametrize("case", PDSH["cases"], ids=[c["name"] for c in PDSH["cases"]])
def test_pdsh_get_cmd_and_kill_cmd(case):
    args = runner.parse_args(case["argv"])
    world = multinode.encode_world_info(case["resources"])
    pdsh = multinode_runner.PDSHRunner(args, world)
    pdsh.python, pdsh.cwd = PY, CWD
    pdsh.add_export("PYTHONPATH", CWD)
    args.master_port = args.master_port or 29500
    cmd, kill, env = pdsh.get_cmd({"X": "1"}, case["resources"])
    assert [part.replace(CWD, "{CWD}") for part in cmd] == case["cmd"]
    assert (kill, env) == (case["kill_cmd"], case["env"])


# --------------------------------------------------------------------------- exports and errors


def test_deepspeed_env_files_and_prefixes():
    env = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "OTHER": "1", "UCX_TLS": "rc", "AISC_JOB_NAME": "j",
           "NCCL_IB_HCA": "mlx5"}
    files = [("/h/.deepspeed_env", "# comment\n\nA=1\nB=x=y\n"), ("./.deepspeed_env", "A=2\n")]
    got = multinode.collect_exports(env, files, ["NCCL"])
    assert got == [("NCCL_DEBUG", "INFO"), ("PYTHONPATH", "/p"), ("UCX_TLS", "rc"), ("A", "1"), ("B", "x=y"),
                   ("A", "2")]  # NCCL_IB_HCA is excluded on AISC; later files win (add_export overwrites)
    with pytest.raises(LaunchError, match=r"/h/.deepspeed_env:2: expected KEY=value, got 'oops'"):
        multinode.parse_env_file("A=1\noops\n", "/h/.deepspeed_env")


def _request(argv, hostfile="a slots=2\nb slots=2\n"):
    args = runner.parse_args(argv + ["t.py"])
    return args, runner.decide(args, LocalHost(None, (0, 1)), hostfile.splitlines(), python="py", env={})


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "openmpi", "-i", "a:0@b"], r"--launcher openmpi: does not support --include/--exclude"),
    (["--launcher", "slurm", "-i", "a:1@b"], r"--launcher slurm: cannot select device ids \[1\] on a"),
    (["--num_gpus", "3"], r"--num_gpus 3: host 'a' has only 2 slot\(s\)"),
    (["--num_nodes", "3"], r"--num_nodes 3: only 2 host\(s\) are available \(a, b\)"),
    (["--launcher", "slurm", "--min_elastic_nodes", "1"], r"elastic start needs the per-node launcher"),
    (["--node_rank", "1"], r"--node_rank 1: only used with --no_ssh"),
])
def test_bad_multi_node_requests_name_flag_and_value(argv, message):
    with pytest.raises(LaunchError, match=message):
        args, decision = _request(argv)
        multinode.make_runner(args, decision.active, decision.pool)


def test_uneven_hosts_for_mpi_name_the_counts():
    args, decision = _request(["--launcher", "mpich"], "a slots=4\nb slots=2\n")
    backend = multinode.make_runner(args, decision.active, decision.pool)
    with pytest.raises(LaunchError, match="--launcher mpich: needs the same slots on every host, the hostfile "
                                          "has a=4, b=2"):
        backend.get_cmd({}, decision.active)


def test_missing_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(multinode_runner.shutil, "which", lambda name: None)
    args, decision = _request(["--launcher", "openmpi"])
    with pytest.raises(LaunchError, match=r"--launcher openmpi: `ompi_info` is not installed"):
        multinode.launch_multinode(args, decision.active, decision.pool, cuda=False, say=print)
