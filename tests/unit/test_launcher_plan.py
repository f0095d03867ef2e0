"""argv -> LaunchPlan for the `deepspeed` launcher: pure, no processes, no GPU needed.

The host is simulated with `LocalHost(visible_devices=...)`, so the CUDA_VISIBLE_DEVICES
rules (slots index the visible list, see plan.py) are tested on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest

from deepspeed.launcher import launch
from deepspeed.launcher.plan import (
    LaunchError,
    LocalHost,
    decode_world_info,
    encode_world_info,
    parse_core_list,
    parse_hostfile,
    parse_node_spec,
)
from deepspeed.launcher.runner import (
    MultiNodeRequest,
    decide,
    parse_args,
    plan_from_argv,
    resolve_master_port,
    visible_cuda_devices,
)

PY = "/usr/bin/python-test"
CPU = LocalHost(visible_devices=None, cpus=(0, 1, 2, 3))
GPU4 = LocalHost(visible_devices=("0", "1", "2", "3"), cpus=(0, 1, 2, 3))
GPU_2_3 = LocalHost(visible_devices=("2", "3"))  # CUDA_VISIBLE_DEVICES=2,3 on an 8-GPU box


def plan(argv, host=CPU, hostfile=None):
    return plan_from_argv(argv, host, hostfile, python=PY)


def cvd(p):
    return [env.get("CUDA_VISIBLE_DEVICES") for env in p.envs]


# --------------------------------------------------------------------------- env and argv per rank


def test_cpu_host_defaults_to_one_rank_with_full_env():
    p = plan(["train.py", "--lr", "0.1"])
    assert p.world_size == 1 and (p.master_addr, p.master_port) == ("127.0.0.1", 29500)
    assert dict(p.envs[0]) == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "CROSS_RANK": "0", "CROSS_SIZE": "1",
    }  # no CUDA_VISIBLE_DEVICES on a CPU-only host
    assert p.argvs[0] == (PY, "-u", "train.py", "--local_rank=0", "--lr", "0.1")


def test_num_gpus_on_cpu_host_starts_n_processes():
    p = plan(["--num_gpus", "3", "--master_addr", "10.0.0.5", "--master_port", "1234", "t.py"])
    assert [(r.global_rank, r.local_rank) for r in p.ranks] == [(0, 0), (1, 1), (2, 2)]
    for i, env in enumerate(p.envs):
        assert [env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == [str(i), str(i), "3", "3"]
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "1234")
    assert [a[3] for a in p.argvs] == ["--local_rank=0", "--local_rank=1", "--local_rank=2"]


def test_module_no_python_and_no_local_rank_argv():
    assert plan(["--module", "pkg.train", "a"]).argvs[0] == (PY, "-u", "-m", "pkg.train", "--local_rank=0", "a")
    assert plan(["--no_python", "./run.sh", "a"]).argvs[0] == ("./run.sh", "--local_rank=0", "a")
    assert plan(["--no_local_rank", "t.py", "a"]).argvs[0] == (PY, "-u", "t.py", "a")
    # flags after the script belong to the script, even when they look like launcher flags
    assert plan(["t.py", "--num_gpus", "8"]).argvs[0][-2:] == ("--num_gpus", "8")
    with pytest.raises(LaunchError, match="--module and --no_python"):
        plan(["--module", "--no_python", "x"])


def test_plan_is_frozen():
    p = plan(["--num_gpus", "2", "t.py"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.world_size = 3
    with pytest.raises(TypeError):
        p.ranks[0].env["RANK"] = "9"


# --------------------------------------------------------------------------- include / exclude


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], ["0,1,2,3"] * 4),
        (["--num_gpus", "2"], ["0,1"] * 2),
        (["-i", "localhost:1,3"], ["1,3"] * 2),
        (["--include", "localhost:3,1,1"], ["1,3"] * 2),  # sorted, de-duplicated
        (["--include", "localhost"], ["0,1,2,3"] * 4),
        (["-e", "localhost:0,2"], ["1,3"] * 2),
        (["--exclude", "localhost:1"], ["0,2,3"] * 3),
    ],
)
def test_include_exclude_num_gpus_on_gpu_host(argv, expected):
    assert cvd(plan(argv + ["t.py"], GPU4)) == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], ["2,3"] * 2),
        (["--num_gpus", "1"], ["2"]),
        (["--include", "localhost:1"], ["3"]),  # slot 1 = second *visible* device = physical 3
        (["--exclude", "localhost:0"], ["3"]),
    ],
)
def test_slots_index_cuda_visible_devices(argv, expected):
    p = plan(argv + ["t.py"], GPU_2_3)
    assert cvd(p) == expected
    assert [env["LOCAL_RANK"] for env in p.envs] == [str(i) for i in range(len(expected))]


def test_visible_cuda_devices_from_env():
    assert visible_cuda_devices(0, "0,1") is None  # no CUDA at all
    assert visible_cuda_devices(2, None) == ("0", "1")
    assert visible_cuda_devices(2, " 5, 7 ") == ("5", "7")
    assert visible_cuda_devices(1, "GPU-abc,GPU-def") == ("GPU-abc",)  # torch saw only one valid entry


def test_include_exclude_on_cpu_host_use_one_slot_per_core():
    assert plan(["--include", "localhost:0,1", "t.py"]).world_size == 2
    assert plan(["--exclude", "localhost:1", "t.py"]).world_size == 3


@pytest.mark.parametrize(
    "argv, host, message",
    [
        (["--include", "localhost:a"], GPU4, r"--include 'localhost:a': slot 'a' is not a non-negative integer"),
        (["--include", "localhost:0,"], GPU4, r"--include 'localhost:0,': slot '' is not"),
        (["--exclude", ":0"], GPU4, r"--exclude ':0': empty host name"),
        (["--include", "localhost:4"], GPU4, r"--include 'localhost:4': slot 4 does not exist on localhost \(.*: 0-3"),
        (["--include", "localhost:2"], GPU_2_3, r"slot 2 does not exist.*visible CUDA devices 2,3"),
        (["--include", "worker-1:0"], GPU4, r"--include 'worker-1:0': host 'worker-1' is not available"),
        (["-i", "localhost:0", "-e", "localhost:1"], GPU4, "mutually exclusive"),
        (["-i", "localhost:0", "--num_gpus", "1"], GPU4, "cannot be combined with --include/--exclude"),
        (["--exclude", "localhost"], GPU4, "leaves no slots"),
        (["--num_gpus", "3"], GPU_2_3, r"--num_gpus 3: asks for slot 2 but only 2 device\(s\) are visible"),
        (["--num_gpus", "0"], CPU, "--num_gpus 0: must be >= 1"),
        (["--num_nodes", "0"], CPU, "--num_nodes 0: must be >= 1"),
        (["--num_nodes", "2"], CPU, r"--num_nodes 2: needs a hostfile listing the nodes \(-H FILE"),
        (["--force_multi"], CPU, "--force_multi: needs a hostfile"),
        (["--node_rank", "1"], CPU, r"--node_rank 1: a job without a hostfile has one node"),
        (["--autotuning", "tune"], CPU, "autotuner is not implemented"),
    ],
)
def test_bad_requests_name_flag_and_value(argv, host, message):
    with pytest.raises(LaunchError, match=message):
        plan(argv + ["t.py"], host)


def test_parse_node_spec_multiple_hosts():
    assert parse_node_spec("--include", "a:2,0@b@a:1") == {"a": [0, 1, 2], "b": []}


# --------------------------------------------------------------------------- hostfiles


def test_hostfile_with_only_localhost_is_fine():
    lines = ["# comment", "", "localhost slots=2"]
    p = plan(["t.py"], CPU, lines)
    assert p.world_size == 2 and cvd(p) == [None, None]
    assert cvd(plan(["t.py"], GPU4, lines)) == ["0,1", "0,1"]


def test_hostfile_multi_host_goes_to_the_backend_unless_filtered_to_one_host():
    lines = ["localhost slots=2", "worker-1 slots=4"]
    decision = decide(parse_args(["t.py"]), CPU, lines, python=PY, env={})
    assert isinstance(decision, MultiNodeRequest)
    assert decision.active == {"localhost": [0, 1], "worker-1": [0, 1, 2, 3]}
    assert plan(["--include", "localhost", "t.py"], CPU, lines).world_size == 2
    assert plan(["--num_nodes", "1", "t.py"], CPU, lines).world_size == 2  # top host only
    notes = []
    job = decide(parse_args(["t.py"]), CPU, ["worker-1 slots=4"], python=PY, env={}, notes=notes)
    assert job.plan.world_size == 4 and "'worker-1' is not recognised as this machine" in notes[0]


def test_hostfile_slots_beyond_visible_devices():
    with pytest.raises(LaunchError, match="hostfile slots: asks for slot 2"):
        plan(["t.py"], GPU_2_3, ["localhost slots=3"])


def test_bad_hostfiles():
    with pytest.raises(LaunchError, match=r"hf:2: bad hostfile line 'worker slots=x'"):
        parse_hostfile(["a slots=1", "worker slots=x"], "hf")
    with pytest.raises(LaunchError, match="listed twice"):
        parse_hostfile(["a slots=1", "a slots=2"])
    with pytest.raises(LaunchError, match="no 'HOST slots=N' entries"):
        parse_hostfile(["# nothing"])


# --------------------------------------------------------------------------- other flags


def test_bind_cores_to_rank_splits_cores_and_sets_omp_threads():
    p = plan(["--num_gpus", "2", "--bind_cores_to_rank", "t.py"])
    assert [r.cpu_cores for r in p.ranks] == [(0, 1), (2, 3)]
    assert [env["OMP_NUM_THREADS"] for env in p.envs] == ["2", "2"]
    p = plan(["--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "1,3-5", "t.py"])
    assert [r.cpu_cores for r in p.ranks] == [(1, 3), (4, 5)]
    assert plan(["--num_gpus", "2", "t.py"]).ranks[0].cpu_cores is None
    with pytest.raises(LaunchError, match="cannot be split among 8 local ranks"):
        plan(["--num_gpus", "8", "--bind_cores_to_rank", "t.py"])
    assert parse_core_list("0,2-4,3") == [0, 2, 3, 4]
    with pytest.raises(LaunchError, match="--bind_core_list '1,x': bad entry 'x'"):
        parse_core_list("1,x")


def test_each_rank_log_paths():
    p = plan(["--num_gpus", "2", "--enable_each_rank_log", "/tmp/logs/", "t.py"])
    assert [r.log_path for r in p.ranks] == ["/tmp/logs/rank0.log", "/tmp/logs/rank1.log"]
    assert plan(["t.py"]).ranks[0].log_path is None


def test_launch_py_world_info_second_node():
    info = encode_world_info({"node-a": [0, 1], "node-b": [4, 5]})
    assert decode_world_info(info) == {"node-a": ["0", "1"], "node-b": ["4", "5"]}
    args = launch.parse_args([f"--world_info={info}", "--node_rank=1", "--master_addr=10.1.1.1", "t.py", "x"])
    p = launch.plan_from_launch_args(args)
    assert [(r.global_rank, r.local_rank) for r in p.ranks] == [(2, 0), (3, 1)]
    env = p.envs[1]
    keys = ("WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "CUDA_VISIBLE_DEVICES")
    assert [env[k] for k in keys] == ["4", "1", "2", "4,5"]
    assert p.argvs[1][-3:] == ("t.py", "--local_rank=1", "x")
    with pytest.raises(LaunchError, match="--world_info 'zz'"):
        decode_world_info("zz")


# --------------------------------------------------------------------------- exit codes and ports


def test_exit_codes_and_descriptions():
    assert launch.exit_code(7) == 7 and launch.exit_code(-9) == 137 and launch.exit_code(-15) == 143
    assert launch.describe_exit(-9) == "was killed by SIGKILL (possibly the out-of-memory killer) (exit code 137)"
    assert launch.describe_exit(3) == "exited with code 3"


def test_busy_default_port_is_replaced_but_explicit_port_kept():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        busy = held.getsockname()[1]
        port, message = resolve_master_port(None, default=busy)
        assert port != busy and f"{busy} is busy; using free port {port}" in message
        port, message = resolve_master_port(busy)
        assert port == busy and "already in use" in message
