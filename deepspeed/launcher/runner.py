"""The `deepspeed` command: upstream's flags in, local ranks started and supervised.

This module does the impure lookups (CUDA devices, hostfile, a free master port), turns
argv into a pure `LaunchPlan` (plan.py) and hands it to the in-process spawner
(launch.run_plan). Only single-node launches are implemented; anything that needs a second
machine fails with `plan.MULTI_NODE_UNSUPPORTED` instead of guessing. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Sequence

from .launch import PREFIX, pid_file, run_plan
from .plan import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    MULTI_NODE_UNSUPPORTED,
    LaunchError,
    LaunchPlan,
    LocalHost,
    ScriptSpec,
    build_node_plan,
    parse_core_list,
    parse_hostfile,
    resolve_local_devices,
)

DEFAULT_HOSTFILE = "/job/hostfile"  # upstream's DLTS_HOSTFILE; used only when it exists
LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich")
MULTI_NODE_ONLY = "(multi-node only; accepted and ignored)"
# compat: upstream's name for the file of extra environment variables exported to remote nodes
# (accelerate imports it). One node inherits the caller's environment, so nothing reads it here.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Upstream 0.19.8's flags. Options left at None mean 'not given' (they change defaults)."""
    p = argparse.ArgumentParser(
        prog="deepspeed", description="Launch a DeepSpeed training script on the local node's devices."
    )
    add = p.add_argument
    add("-H", "--hostfile", default=None, help=f"'host slots=N' lines; default {DEFAULT_HOSTFILE} if present")
    add("-i", "--include", default="", help="resources to use: NAME[:SLOT[,SLOT...]][@NAME...], e.g. localhost:0,1")
    add("-e", "--exclude", default="", help="resources to leave out, same format as --include")
    add("--num_nodes", type=int, default=None, help="number of nodes (only 1 is supported)")
    add("--num_gpus", "--num_accelerators", type=int, default=None, help="ranks per node (CPU host: default 1)")
    add("--master_addr", default="", help=f"rendezvous address (default {DEFAULT_MASTER_ADDR})")
    add("--master_port", type=int, default=None, help=f"default {DEFAULT_MASTER_PORT}, or a free port if that is busy")
    add("--node_rank", type=int, default=-1, help="node index; only 0 is meaningful on one node")
    add("--launcher", default="pdsh", type=str.lower, choices=LAUNCHERS, help=f"backend {MULTI_NODE_ONLY}")
    add("--launcher_args", default="", help=MULTI_NODE_ONLY)
    add("--module", action="store_true", help="run the script as a module: python -u -m SCRIPT")
    add("--no_python", action="store_true", help="execute the script directly instead of through python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--no_ssh", action="store_true", help=MULTI_NODE_ONLY)
    add("--no_ssh_check", action="store_true", help=MULTI_NODE_ONLY)
    add("--ssh_port", type=int, default=None, help=MULTI_NODE_ONLY)
    add("--venv_script", default=None, help=MULTI_NODE_ONLY)
    add("--force_multi", action="store_true", help="force multi-node mode (not supported)")
    add("--save_pid", action="store_true", help="write the launcher pid to /tmp/<pid>.deepspeed")
    add("--enable_each_rank_log", default=None, help="also write each rank's stdout/stderr to DIR/rank<R>.log")
    add("--bind_cores_to_rank", action="store_true", help="give each local rank its own block of cores")
    add("--bind_core_list", default=None, help="cores to split among ranks, e.g. 0,2-5,7")
    add("--prefix_output", action="store_true", help="prefix output lines with [rankN]: (default: unchanged)")
    add("--autotuning", default="", choices=["", "tune", "run"], help="not supported by this implementation")
    add("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add("-q", "--quiet", action="store_true", help="alias for --log_level error")
    add("user_script", help="the training script (a module with --module, an executable with --no_python)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments passed through to the script")
    args = p.parse_args(argv)
    if args.quiet:
        args.log_level = "error"
    return args


def plan_from_args(
    args: argparse.Namespace, host: LocalHost, hostfile_lines: Sequence[str] | None = None, python: str = sys.executable
) -> LaunchPlan:
    """Pure: parsed flags + host facts (+ hostfile text) -> the plan for this node."""
    if args.autotuning:
        raise LaunchError(f"--autotuning {args.autotuning}: the autotuner is not implemented yet; launch without it")
    if args.node_rank not in (-1, 0):
        raise LaunchError(f"--node_rank {args.node_rank}: {MULTI_NODE_UNSUPPORTED}")
    hostfile = parse_hostfile(hostfile_lines, args.hostfile or DEFAULT_HOSTFILE) if hostfile_lines is not None else None
    devices = resolve_local_devices(
        host,
        hostfile,
        include=args.include,
        exclude=args.exclude,
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        force_multi=args.force_multi,
    )
    spec = ScriptSpec(args.user_script, tuple(args.user_args), args.module, args.no_python, args.no_local_rank, python)
    cores = None
    if args.bind_cores_to_rank:
        cores = parse_core_list(args.bind_core_list) if args.bind_core_list else list(host.cpus)
    log_dir = None if args.enable_each_rank_log in (None, "", "None") else args.enable_each_rank_log
    master = (args.master_addr or DEFAULT_MASTER_ADDR, args.master_port or DEFAULT_MASTER_PORT)
    return build_node_plan(
        spec, [devices], master=master, visible_devices=host.visible_devices is not None, cores=cores, log_dir=log_dir
    )


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


# Device nodes / proc entries a CUDA or ROCm driver creates; without any, torch sees 0 devices.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_device_count() -> int:
    """torch.cuda.device_count(), skipping the multi-second torch import on hosts with no GPU driver."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (first failing rank's, or 128+signal)."""
    args = parse_args(argv)
    try:
        host = discover_local_host()
        lines = read_hostfile(args.hostfile)
        plan = plan_from_args(args, host, lines)  # validate before touching sockets
        port, message = resolve_master_port(args.master_port)
        if message and args.log_level in ("debug", "info", "warning"):
            print(f"{PREFIX} {message}", file=sys.stderr)
        if port != plan.master_port:
            args.master_port = port
            plan = plan_from_args(args, host, lines)
    except LaunchError as exc:
        print(f"deepspeed: error: {exc}", file=sys.stderr)
        return 2
    if args.log_level == "debug":
        print(f"{PREFIX} plan: {_describe(plan)}", file=sys.stderr)
    with pid_file(os.getpid() if args.save_pid else None):
        return run_plan(plan, prefix_output=args.prefix_output)


if __name__ == "__main__":
    sys.exit(main())
