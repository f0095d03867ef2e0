"""The `deepspeed` command: upstream's flags in; local ranks, or a whole multi-node job, out.

This module does the impure lookups (CUDA devices, hostfile, a free master port) and decides,
from pure inputs (`decide`), what to run:
* one machine: a `LaunchPlan` (plan.py) executed in-process by launch.run_plan;
* one node of a multi-node job started by hand or by a scheduler (--no_ssh --node_rank N):
  this node's plan plus the link to the other nodes' launchers (node_link.py);
* a multi-node job from here: the pdsh/MPI/SLURM command (multinode.py, multinode_runner.py).
See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

from .constants import DLTS_HOSTFILE
from .constants import EXPORT_ENVS as _EXPORT_ENVS
from .launch import PREFIX, pid_file, run_plan
from .multinode import DEEPSPEED_ENVIRONMENT_NAME, LAUNCHER_CLASSES, launch_multinode  # noqa: F401 (compat name)
from .multinode import DEEPSPEED_ENVIRONMENT_PATHS as _ENV_PATHS
from .plan import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    LaunchError,
    LaunchPlan,
    LocalHost,
    NodeJob,
    ScriptSpec,
    env_int,
    job_token,
    map_local_slots,
    node_job,
    parse_core_list,
    parse_hostfile,
    resolve_local_devices,
)
from .resources import (GPU_DRIVER_PATHS, check_counts, cuda_device_count, encode_world_info,  # noqa: F401
                        filter_resources, select_resources)

DEFAULT_HOSTFILE = DLTS_HOSTFILE  # used only when it exists, as upstream
LAUNCHERS = tuple(LAUNCHER_CLASSES)
MULTI_NODE = "(multi-node)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Upstream 0.19.8's flags (plus 0.19.7's elastic ones). Options left at None mean 'not given'."""
    p = argparse.ArgumentParser(prog="deepspeed", description="Launch a DeepSpeed training job on this machine's "
                                "devices, or on the hosts of a hostfile through pdsh, MPI or SLURM.")
    add = p.add_argument
    add("-H", "--hostfile", default=None, help=f"'host slots=N' lines; default {DEFAULT_HOSTFILE} if present")
    add("-i", "--include", default="", help="resources to use: NAME[:SLOT[,SLOT...]][@NAME...], e.g. worker-0:0,1")
    add("-e", "--exclude", default="", help="resources to leave out, same format as --include")
    add("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", type=int, default=None, help="ranks per node (CPU host: default 1)")
    add("--master_addr", default="", help="rank 0's address (default: 127.0.0.1 on one node; the first host's "
        "`hostname -I` over ssh; with --no_ssh $MASTER_ADDR or the first host)")
    add("--master_port", type=int, default=None, help=f"default {DEFAULT_MASTER_PORT} ($MASTER_PORT with --no_ssh); "
        "one node: a free port if that is busy")
    add("--node_rank", type=int, default=-1, help="this node's index with --no_ssh (default $NODE_RANK)")
    add("--launcher", default="pdsh", type=str.lower, choices=LAUNCHERS, help=f"backend {MULTI_NODE}")
    add("--launcher_args", default="", help=f"extra arguments for the backend, one quoted string {MULTI_NODE}")
    add("--module", action="store_true", help="run the script as a module: python -u -m SCRIPT")
    add("--no_python", action="store_true", help="execute the script directly instead of through python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--no_ssh", action="store_true", help="start only this node's ranks (run it on every node with --node_rank)")
    add("--no_ssh_check", action="store_true", help=f"skip the passwordless-ssh probe {MULTI_NODE}")
    add("--ssh_port", type=int, default=None, help=f"ssh port {MULTI_NODE}")
    add("--venv_script", default=None, help=f"script pdsh sources on every host first {MULTI_NODE}")
    add("--force_multi", action="store_true", help="use the multi-node backend even for one host")
    add("--save_pid", action="store_true", help="write the launcher pid to /tmp/<pid>.deepspeed")
    add("--enable_each_rank_log", default="None", help="also write each rank's stdout/stderr to DIR/rank<R>.log")
    add("--bind_cores_to_rank", action="store_true", help="give each local rank its own block of cores")
    add("--bind_core_list", default=None, help="cores to split among ranks, e.g. 0,2-5,7")
    add("--elastic_training", action="store_true", help="elastic start: see --min_elastic_nodes")
    add("--min_elastic_nodes", type=int, default=-1, help="start with at least this many nodes when the others "
        "do not join within DS_LAUNCHER_RENDEZVOUS_TIMEOUT")
    add("--max_elastic_nodes", type=int, default=-1, help="start as soon as this many nodes joined")
    add("--prefix_output", action="store_true", help="prefix output lines with [rankN]: (default: unchanged)")
    add("--autotuning", default="", choices=["", "tune", "run"], help="not supported by this implementation")
    add("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add("-q", "--quiet", action="store_true", help="alias for --log_level error")
    add("user_script", help="the training script (a module with --module, an executable with --no_python)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments passed through to the script")
    args = p.parse_args(argv)
    if args.quiet:
        args.log_level = "error"
    args.elastic_training = args.elastic_training or args.min_elastic_nodes >= 0 or args.max_elastic_nodes >= 0
    return args


@dataclass(frozen=True)
class MultiNodeRequest:
    """The job spans hosts and is started from here through --launcher (multinode.py)."""

    active: "OrderedDict[str, list[int]]"  # {host: slot ids} after --include/--exclude/--num_*
    pool: "OrderedDict[str, int]"  # the hostfile


def decide(args: argparse.Namespace, host: LocalHost, hostfile_lines: Sequence[str] | None = None,
           python: str = sys.executable, env: Mapping[str, str] | None = None,
           notes: list[str] | None = None) -> NodeJob | MultiNodeRequest:
    """Pure: parsed flags + host facts (+ hostfile text, environment) -> what to run."""
    env = os.environ if env is None else env
    notes = [] if notes is None else notes
    if args.autotuning:
        raise LaunchError(f"--autotuning {args.autotuning}: the autotuner is not implemented yet; launch without it")
    spec = ScriptSpec(args.user_script, tuple(args.user_args), args.module, args.no_python, args.no_local_rank, python)
    cores = None
    if args.bind_cores_to_rank:
        cores = tuple(parse_core_list(args.bind_core_list) if args.bind_core_list else host.cpus)
    log_dir = None if args.enable_each_rank_log in (None, "", "None") else args.enable_each_rank_log
    options = dict(visible_devices=host.visible_devices is not None, cores=cores, log_dir=log_dir)
    elastic = (args.min_elastic_nodes, args.max_elastic_nodes)
    if hostfile_lines is None:
        return _no_hostfile(args, host, spec, env, options)
    pool = parse_hostfile(hostfile_lines, args.hostfile or DEFAULT_HOSTFILE)
    active = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    if args.no_ssh:
        node_rank = args.node_rank if args.node_rank >= 0 else env_int(env, ["NODE_RANK", "SLURM_NODEID"],
                                                                      "this node's rank")
        if node_rank is None:
            raise LaunchError("--no_ssh: pass --node_rank N (or set NODE_RANK) on each node, N = the node's "
                              f"position in the hostfile ({', '.join(active)})")
        if not 0 <= node_rank < len(active):
            raise LaunchError(f"--node_rank {node_rank}: must be in [0, {len(active)}) for the {len(active)} "
                              f"node(s) {', '.join(active)}")
        world = OrderedDict((h, [str(s) for s in slots]) for h, slots in active.items())
        this = list(active)[node_rank]
        world[this] = map_local_slots(host, active[this], f"hostfile slots of {this}")
        master = (args.master_addr or env.get("MASTER_ADDR") or next(iter(active)),
                  args.master_port or env_int(env, ["MASTER_PORT"], "rank 0's port") or DEFAULT_MASTER_PORT)
        token = job_token(encode_world_info(active), args.user_script)
        return node_job(spec, world, node_rank, master, env=env, token=token, elastic=elastic, **options)
    LAUNCHER_CLASSES[args.launcher].validate_active_resources(active)  # also when one host is left (upstream)
    if args.node_rank >= 0:
        raise LaunchError(f"--node_rank {args.node_rank}: only used with --no_ssh (each node started by you); "
                          f"--launcher {args.launcher} numbers the nodes itself")
    if args.force_multi or len(active) > 1:
        if args.elastic_training and args.launcher != "pdsh":
            raise LaunchError(f"--min/--max_elastic_nodes: the elastic start needs the per-node launcher "
                              f"(--launcher pdsh or --no_ssh), not --launcher {args.launcher}")
        return MultiNodeRequest(active, pool)
    name, slots = next(iter(active.items()))
    if name not in host.names:
        notes.append(f"host {name!r} is not recognised as this machine ({', '.join(sorted(host.names))}); "
                     "launching its ranks here, as upstream does (--force_multi starts them on it through "
                     f"--launcher {args.launcher})")
    devices = map_local_slots(host, slots)
    master = (args.master_addr or DEFAULT_MASTER_ADDR, args.master_port or DEFAULT_MASTER_PORT)
    return node_job(spec, {name: devices}, 0, master, env=env, **options)


def _no_hostfile(args: argparse.Namespace, host: LocalHost, spec: ScriptSpec, env: Mapping[str, str],
                 options: dict) -> NodeJob:
    check_counts(args.num_nodes, args.num_gpus, args.include, args.exclude)
    if (args.num_nodes or 1) > 1 or args.force_multi:
        flag = f"--num_nodes {args.num_nodes}" if (args.num_nodes or 1) > 1 else "--force_multi"
        raise LaunchError(f"{flag}: needs a hostfile listing the nodes (-H FILE; {DEFAULT_HOSTFILE} does not "
                          "exist)")
    if args.node_rank > 0:
        raise LaunchError(f"--node_rank {args.node_rank}: a job without a hostfile has one node (rank 0); pass "
                          "-H FILE listing every node")
    devices = resolve_local_devices(host, include=args.include, exclude=args.exclude, num_gpus=args.num_gpus)
    master = (args.master_addr or DEFAULT_MASTER_ADDR, args.master_port or DEFAULT_MASTER_PORT)
    return node_job(spec, {"localhost": devices}, 0, master, env=env, **options)


def plan_from_args(
    args: argparse.Namespace, host: LocalHost, hostfile_lines: Sequence[str] | None = None, python: str = sys.executable
) -> LaunchPlan:
    """Pure: the plan of this node (a LaunchError for a job started through pdsh/MPI/SLURM)."""
    decision = decide(args, host, hostfile_lines, python)
    if isinstance(decision, MultiNodeRequest):
        raise LaunchError(f"the job spans {len(decision.active)} hosts ({', '.join(decision.active)}): it is "
                          f"started through --launcher {args.launcher}, not planned on this node")
    return decision.plan


def plan_from_argv(
    argv: Sequence[str], host: LocalHost, hostfile_lines: Sequence[str] | None = None, python: str = sys.executable
) -> LaunchPlan:
    """Pure: `deepspeed` argv -> LaunchPlan (what the unit tests drive)."""
    return plan_from_args(parse_args(argv), host, hostfile_lines, python)


# --------------------------------------------------------------------------- host facts (impure)


def visible_cuda_devices(device_count: int, cuda_visible_devices: str | None) -> tuple[str, ...] | None:
    """The device ids a child would see, in order; None when there is no CUDA device.

    torch already counts only the devices CUDA_VISIBLE_DEVICES exposes, so its entries (ids,
    UUIDs or MIG names) are kept verbatim and truncated to that count.
    """
    if device_count <= 0:
        return None
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(device_count))
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    return tuple(entries[:device_count])


def discover_local_host() -> LocalHost:
    """Facts about this machine: visible CUDA devices (honouring CUDA_VISIBLE_DEVICES), cores, names."""
    count = cuda_device_count()
    hostname = socket.gethostname()
    return LocalHost(
        visible_devices=visible_cuda_devices(count, os.environ.get("CUDA_VISIBLE_DEVICES")),
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        names=frozenset({"localhost", "127.0.0.1", hostname, hostname.split(".")[0]}),
    )


def read_hostfile(path: str | None) -> list[str] | None:
    """Hostfile lines; a missing default hostfile means 'local resources', a missing -H is an error."""
    if path is None:
        path = DEFAULT_HOSTFILE
        if not os.path.isfile(path):
            return None
    try:
        with open(path) as fd:
            return fd.readlines()
    except OSError as exc:
        message = f"--hostfile {path!r}: cannot read it ({exc.strerror}); drop -H to use local devices"
        raise LaunchError(message) from None


def port_is_free(port: int) -> bool:
    """Whether a listener could bind `port` (SO_REUSEADDR, like c10d, so TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def resolve_master_port(requested: int | None, default: int = DEFAULT_MASTER_PORT) -> tuple[int, str | None]:
    """(port, message): an explicit port is kept (with a warning if busy); a busy default is replaced."""
    if requested is not None:
        if port_is_free(requested):
            return requested, None
        return requested, f"warning: --master_port {requested} is already in use; rank 0 may fail to bind it"
    if port_is_free(default):
        return default, None
    port = free_port()
    return port, f"default MASTER_PORT {default} is busy; using free port {port} (pass --master_port to pin one)"


def _describe(plan: LaunchPlan) -> str:
    lines = [f"world_size={plan.world_size} master={plan.master_addr}:{plan.master_port}"]
    for rank in plan.ranks:
        env = " ".join(f"{k}={v}" for k, v in sorted(rank.env.items()))
        lines.append(f"  rank {rank.global_rank}: {env} :: {' '.join(rank.argv)}")
    return "\n".join(lines)


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (first failing rank's, or 128+signal).

    A bad request prints `deepspeed: error: ...` and returns 2; called with an explicit argument
    list (upstream's `main(args=[...])`), it raises the LaunchError (a ValueError) instead, as upstream."""
    if args is None:
        try:
            return _main(None)
        except LaunchError as exc:
            print(f"deepspeed: error: {exc}", file=sys.stderr)
            return 2
    return _main(args)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    verbose = args.log_level in ("debug", "info", "warning")
    notes: list[str] = []
    host = discover_local_host()
    lines = read_hostfile(args.hostfile)
    if lines is not None and args.hostfile is None:
        args.hostfile = DEFAULT_HOSTFILE
    decision = decide(args, host, lines, notes=notes)  # validate before touching sockets or ssh
    for note in notes:
        _say(f"warning: {note}")
    if isinstance(decision, MultiNodeRequest):
        args.master_port = args.master_port or DEFAULT_MASTER_PORT
        return launch_multinode(args, decision.active, decision.pool, cuda=host.visible_devices is not None,
                                say=_say if verbose else lambda m: None)
    job = decision
    if job.link is None:  # one node: a busy default port is replaced (every node would have to agree)
        port, message = resolve_master_port(args.master_port)
        if message and verbose:
            _say(message)
        if port != job.master[1]:
            args.master_port = port
            job = decide(args, host, lines)
    if args.log_level == "debug":
        _say(f"plan: {_describe(job.plan)}")
    with pid_file(os.getpid() if args.save_pid else None):
        return run_plan(job.plan, prefix_output=args.prefix_output, link=job.link, replan=job.plan_for)


# --------------------------------------------------------------------------- compat: upstream runner helpers
# Upstream's names for the resource steps (its unit tests and some tools call them); thin wrappers.
EXPORT_ENVS = _EXPORT_ENVS
DEEPSPEED_ENVIRONMENT_PATHS = _ENV_PATHS
DLTS_HOSTFILE = DEFAULT_HOSTFILE


def fetch_hostfile(hostfile_path: str) -> "OrderedDict[str, int] | None":
    lines = read_hostfile(hostfile_path) if os.path.isfile(hostfile_path) else None
    return None if lines is None else parse_hostfile(lines, hostfile_path)


def _parse_hostfile(hostfile_lines: Sequence[str]) -> "OrderedDict[str, int]":
    return parse_hostfile(hostfile_lines)


def parse_resource_filter(host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""):
    return filter_resources(host_info, include_str, exclude_str)


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str, exclusion: str):
    return filter_resources({h: list(range(n)) for h, n in resource_pool.items()}, inclusion, exclusion)


def apply_num_nodes_and_gpus(active_resources: Mapping[str, Sequence[int]], num_nodes: int | None,
                             num_gpus: int | None) -> "OrderedDict[str, list[int]]":
    """The first num_nodes hosts, slots 0..num_gpus-1 on each (None/-1: unchanged), as upstream."""
    active = OrderedDict((h, list(s)) for h, s in active_resources.items())
    if num_nodes is not None and num_nodes > 0:
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus is not None and num_gpus > 0:
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    return active


if __name__ == "__main__":
    sys.exit(main())
