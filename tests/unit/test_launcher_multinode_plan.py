"""Multi-node planning without processes: resources, per-node jobs, the node link's rules and
protocol (threads on loopback), MPI/SLURM rank discovery, the MPICH helper and NUMA binding."""

from __future__ import annotations

import socket
import threading

import pytest

from deepspeed.comm.init import discover_env
from deepspeed.launcher import launcher_helper
from deepspeed.launcher.node_link import NodeLink, Stop, choose_start_set
from deepspeed.launcher.plan import (
    LaunchError,
    LinkSpec,
    LocalHost,
    ScriptSpec,
    elastic_bounds,
    job_token,
    link_settings,
    node_job,
)
from deepspeed.launcher.resources import first_slurm_host, parse_hostfile, select_resources
from deepspeed.launcher.runner import decide, parse_args
from deepspeed.utils.numa import compress_core_list, get_numactl_cmd, numactl_cmd

SPEC = ScriptSpec("t.py", python="py")


# --------------------------------------------------------------------------- resources


def test_hostfile_accepts_openmpi_fields_and_comments():
    pool = parse_hostfile(["a slots=4 max_slots=8", "b slots=2  # spare box", "  # c slots=1"])
    assert pool == {"a": 4, "b": 2}
    with pytest.raises(LaunchError, match=r"hf:1: bad hostfile line 'a slots=4 extra'"):
        parse_hostfile(["a slots=4 extra"], "hf")
    with pytest.raises(LaunchError, match=r"host 'a' is listed twice \(first with slots=4\)"):
        parse_hostfile(["a slots=4", "a slots=1"])


def test_select_resources_follows_upstream_order():
    pool = {"a": 4, "b": 4, "c": 2}
    assert select_resources(pool, include="a:0,2@c") == {"a": [0, 2], "c": [0, 1]}
    assert select_resources(pool, exclude="b@a:3") == {"a": [0, 1, 2], "c": [0, 1]}
    assert select_resources(pool, num_nodes=2, num_gpus=2) == {"a": [0, 1], "b": [0, 1]}
    with pytest.raises(LaunchError, match="--exclude 'a@b@c' leaves no slots"):
        select_resources(pool, exclude="a@b@c")


def test_first_slurm_host():
    assert first_slurm_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_slurm_host("a[1-2]b[7,9]") == "a1b7"
    assert first_slurm_host("node7") == "node7"


# --------------------------------------------------------------------------- per-node jobs


def test_node_job_numbers_ranks_node_by_node_and_replans_for_an_elastic_start():
    world = {"n0": ["0", "1"], "n1": ["0", "1"], "n2": ["0", "1"]}
    env = {"DS_LAUNCHER_CONTROL_PORT": "4001", "DS_LAUNCHER_RENDEZVOUS_TIMEOUT": "7"}
    job = node_job(SPEC, world, 2, ("m", 4000), env=env, token="t", elastic=(2, -1))
    assert [r.global_rank for r in job.plan.ranks] == [4, 5] and job.plan.world_size == 6
    assert job.link == LinkSpec(2, ("n0", "n1", "n2"), "m", 4001, 7.0, "t", 2, None)
    smaller = job.plan_for([0, 2])  # node 1 never joined: this node becomes node rank 1 of 2
    assert (smaller.node_rank, smaller.world_size, smaller.host) == (1, 4, "n2")
    assert [r.global_rank for r in smaller.ranks] == [2, 3] and smaller.envs[0]["CROSS_SIZE"] == "2"
    assert node_job(SPEC, {"n0": ["0"]}, 0, ("m", 1), env={}).link is None  # one node: no link


@pytest.mark.parametrize("env, message", [
    ({"DS_LAUNCHER_CONTROL_PORT": "x"}, r"DS_LAUNCHER_CONTROL_PORT='x' \(the launchers' control port\)"),
    ({"DS_LAUNCHER_CONTROL_PORT": "70000"}, "DS_LAUNCHER_CONTROL_PORT=70000: expected a TCP port"),
    ({"DS_LAUNCHER_RENDEZVOUS_TIMEOUT": "-1"}, "DS_LAUNCHER_RENDEZVOUS_TIMEOUT='-1': expected a positive"),
])
def test_link_settings_errors(env, message):
    with pytest.raises(LaunchError, match=message):
        link_settings(29500, env)
    assert link_settings(29500, {}) == (29501, 600.0)


def test_elastic_bounds():
    assert elastic_bounds(-1, -1, 4) == (None, None) and elastic_bounds(2, 3, 4) == (2, 3)
    with pytest.raises(LaunchError, match=r"--min_elastic_nodes 5: must be between 1 and the number of nodes \(4\)"):
        elastic_bounds(5, -1, 4)
    with pytest.raises(LaunchError, match="--max_elastic_nodes 1 is smaller than --min_elastic_nodes 2"):
        elastic_bounds(2, 1, 4)


def test_no_ssh_node_from_flags_or_scheduler_env():
    lines = ["n0 slots=2", "n1 slots=2"]
    host = LocalHost(visible_devices=("4", "5"))  # this node sees two GPUs: slots index them
    job = decide(parse_args(["-H", "hf", "--no_ssh", "t.py"]), host, lines, python="py",
                 env={"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "5000"})
    assert (job.node_rank, job.master, job.devices) == (1, ("10.0.0.9", 5000), (("0", "1"), ("4", "5")))
    assert job.plan.envs[0]["CUDA_VISIBLE_DEVICES"] == "4,5" and job.link.token == job_token(
        "eyJuMCI6IFswLCAxXSwgIm4xIjogWzAsIDFdfQ==", "t.py")
    job = decide(parse_args(["-H", "hf", "--no_ssh", "--node_rank", "0", "t.py"]), host, lines, python="py", env={})
    assert job.master == ("n0", 29500)  # default master: the first host
    with pytest.raises(LaunchError, match=r"--no_ssh: pass --node_rank N \(or set NODE_RANK\)"):
        decide(parse_args(["-H", "hf", "--no_ssh", "t.py"]), host, lines, python="py", env={})
    with pytest.raises(LaunchError, match=r"NODE_RANK='x' \(this node's rank\): expected a non-negative integer"):
        decide(parse_args(["-H", "hf", "--no_ssh", "t.py"]), host, lines, python="py", env={"NODE_RANK": "x"})


# --------------------------------------------------------------------------- the node link


def _spec(nodes=3, timed_out=False, lo=None, hi=None):
    return LinkSpec(0, tuple(f"h{i}" for i in range(nodes)), "127.0.0.1", 1, 2.0, "t", lo, hi)


def test_choose_start_set():
    assert choose_start_set({0, 1}, _spec(), False) is None
    assert choose_start_set({0, 1, 2}, _spec(), False) == [0, 1, 2]
    assert choose_start_set({0, 2}, _spec(lo=2), True) == [0, 2]
    assert choose_start_set({0, 1, 2}, _spec(hi=2), False) == [0, 1]
    with pytest.raises(LaunchError, match=r"rendezvous timeout after 2 s: node rank 1 \(h1\), node rank 2 \(h2\) "
                                          r"never joined \(1 of 3 node\(s\) did"):
        choose_start_set({0}, _spec(), True)
    with pytest.raises(LaunchError, match="--min_elastic_nodes 3 needs 3"):
        choose_start_set({0, 1}, _spec(lo=3), True)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _links(nodes=2, **kw):
    port = _free_port()
    hosts = tuple(f"h{i}" for i in range(nodes))
    return [NodeLink(LinkSpec(r, hosts, "127.0.0.1", port, kw.get("timeout", 10.0), kw.get("token", "t"))) for r in
            range(nodes)]


def _rendezvous_all(links):
    results = {}
    threads = [threading.Thread(target=lambda link=link: results.__setitem__(
        link.spec.node_rank, _catch(link.rendezvous))) for link in links]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return results


def _wait_stop(link, seconds=10.0):
    pause = threading.Event()
    for _ in range(int(seconds / 0.02)):
        if link.poll() is not None:
            return link.poll()
        pause.wait(0.02)
    raise AssertionError("no stop verdict")


def _catch(fn):
    try:
        return fn()
    except LaunchError as exc:
        return exc


def test_link_failure_fans_out_with_the_first_code():
    links = _links(3)
    try:
        assert _rendezvous_all(links) == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
        verdict = links[2].report(Stop(7, "rank 5 on h2 exited with code 7", 2, "Traceback...", when=100.0))
        assert (verdict.code, verdict.node_rank, verdict.detail) == (7, 2, "Traceback...")
        for link in links[:2]:
            assert _wait_stop(link).reason == "rank 5 on h2 exited with code 7"
    finally:
        for link in links:
            link.close()


def test_link_success_and_lost_member():
    links = _links(3)
    try:
        _rendezvous_all(links)
        assert links[1].report(Stop(0, "done", 1)) is None
        links[1].close()
        links[0].report(Stop(0, "done", 0))
        assert not links[0].all_done()
        links[2].close()  # vanished without a word
        stop = _wait_stop(links[0])
        assert stop.code == 1 and "lost the connection to the launcher of node rank 2 (h2)" in stop.reason
    finally:
        for link in links:
            link.close()


def test_link_turns_away_other_jobs_and_duplicates():
    links = _links(2)
    port = links[0].spec.port
    stranger = NodeLink(LinkSpec(1, ("h0", "h1"), "127.0.0.1", port, 10.0, "other-job"))
    twin = NodeLink(LinkSpec(1, ("h0", "h1"), "127.0.0.1", port, 10.0, "t"))
    try:
        assert _rendezvous_all(links) == {0: [0, 1], 1: [0, 1]}
        with pytest.raises(LaunchError, match="turned this launcher away: this launcher was started for a "
                                              "different job"):
            stranger.rendezvous()
        with pytest.raises(LaunchError, match="node rank 1 already joined; every launcher needs its own"):
            twin.rendezvous()
    finally:
        for link in (*links, stranger, twin):
            link.close()


# --------------------------------------------------------------------------- rank discovery


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ("3", "4", "1", "127.0.0.1", "29500")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n0"}, ("3", "8", "1", "n0", "29500")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     ("3", "8", "0", "", "29500")),  # spans hosts, nothing names rank 0's: mpi4py or an error
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
     ("1", "2", "1", "127.0.0.1", "29500")),
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MASTER_PORT": "7000"},
     ("5", "8", "1", "127.0.0.1", "7000")),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
      "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}, ("9", "16", "1", "gpu07", "29500")),
])
def test_discover_env(env, expected):
    found = discover_env(env)
    assert tuple(found[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")) == expected
    assert discover_env({}) is None


def test_mpich_helper_maps_rank_variables():
    env = launcher_helper.map_env({"PMI_RANK": "3", "PMIX_RANK": "3", "MPI_LOCALRANKID": "1"}, "mpich")
    assert (env["RANK"], env["LOCAL_RANK"]) == ("3", "1")
    with pytest.raises(SystemExit, match="rank variables disagree"):
        launcher_helper.map_env({"PMI_RANK": "3", "PMIX_RANK": "2", "MPI_LOCALRANKID": "1"}, "mpich")
    with pytest.raises(SystemExit, match="none of PMIX_RANK, PMI_RANK is set"):
        launcher_helper.map_env({}, "mpich")


def test_numactl_binding():
    assert compress_core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert numactl_cmd([4, 5], [[0, 1, 2, 3], [4, 5, 6, 7]]) == ["numactl", "-m", "1", "-C", "4-5"]
    assert numactl_cmd([3, 4], [[0, 1, 2, 3], [4, 5, 6, 7]]) == ["numactl", "-C", "3-4"]  # spans nodes
    assert get_numactl_cmd("0-5", 3, 2, []) == (2, ["numactl", "-C", "4-5"])
    with pytest.raises(ValueError, match="2 core\\(s\\) cannot be split among 4 local ranks"):
        get_numactl_cmd("0-1", 4, 0, [])


def test_launch_py_takes_node_rank_and_master_from_a_scheduler():
    from deepspeed.launcher import launch
    from deepspeed.launcher.resources import encode_world_info

    info = encode_world_info({"n0": [0], "n1": [0]})
    args = launch.parse_args([f"--world_info={info}", "t.py"])
    job = launch.job_from_launch_args(args, env={"NODE_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "6000"})
    assert (job.node_rank, job.master, job.link.port) == (1, ("n0", 6000), 6001)
    args = launch.parse_args([f"--world_info={info}", "--node_rank=0", "--master_addr=m", "--master_port=7", "t.py"])
    job = launch.job_from_launch_args(args, env={"NODE_RANK": "1", "MASTER_ADDR": "n0", "SLURM_NODEID": "1"})
    assert (job.node_rank, job.master) == (0, ("m", 7))  # flags win
    job = launch.job_from_launch_args(launch.parse_args([f"--world_info={info}", "t.py"]), env={"SLURM_NODEID": "1"})
    assert (job.node_rank, job.master) == (1, ("127.0.0.1", 29500))
