"""Start a multi-node job through a cluster tool: exports, ssh probes, the command, signals.

`runner.main` calls this when the resources span more than one host (or --force_multi). The
command itself comes from multinode_runner.py; this module gathers what upstream's runner.main
gathers around it (the variables to export, `.deepspeed_env` files, the master address) and then
supervises the tool's process: its exit code becomes ours (128+N when it dies by signal N,
where upstream exits 0), and SIGINT/SIGTERM/SIGHUP are forwarded. For pdsh, whose remote
commands outlive a killed pdsh, the forwarding also runs upstream's kill command (`pkill -f` of
the launch.py command line on every host) as upstream does.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .constants import EXCLUDE_ENVS, EXPORT_ENVS, PDSH_LAUNCHER
from .multinode_runner import (
    IMPIRunner,
    MPICHRunner,
    MultiNodeRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)
from .resources import LaunchError, encode_world_info

LAUNCHER_CLASSES: dict[str, type[MultiNodeRunner]] = {
    "pdsh": PDSHRunner,
    "openmpi": OpenMPIRunner,
    "mpich": MPICHRunner,
    "impi": IMPIRunner,
    "mvapich": MVAPICHRunner,
    "slurm": SlurmRunner,
}
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
KILL_TIMEOUT_S = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class BackendJob:
    """What runs on this machine to start the whole job: the tool's command and environment."""

    launcher: str
    cmd: tuple[str, ...]
    env: Mapping[str, str]
    kill_cmd: tuple[str, ...] | None = None  # pdsh only


# --------------------------------------------------------------------------- pure parts


def parse_env_file(text: str, path: str) -> list[tuple[str, str]]:
    """`KEY=value` lines of a .deepspeed_env file; blank lines and # comments are skipped."""
    pairs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise LaunchError(f"{path}:{lineno}: expected KEY=value, got {line!r}")
        pairs.append((key.strip(), value))
    return pairs


def collect_exports(env: Mapping[str, str], env_files: Sequence[tuple[str, str]],
                    accelerator_prefixes: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Variables every node gets: ours whose names start with EXPORT_ENVS (+ the accelerator's
    prefixes), except EXCLUDE_ENVS, then the .deepspeed_env files in order (later ones win)."""
    excluded = {name for marker, names in EXCLUDE_ENVS.items() if marker in env for name in names}
    prefixes = tuple(EXPORT_ENVS) + tuple(accelerator_prefixes)
    out = [(k, v) for k, v in env.items() if k.startswith(prefixes) and k not in excluded]
    for path, text in env_files:
        out += parse_env_file(text, path)
    return out


def make_runner(args: Any, active: Mapping[str, Sequence[int]], pool: Mapping[str, int],
                **facts: Any) -> MultiNodeRunner:
    """The runner for --launcher, checked against the flags and the resources it must express.

    `facts` pins python / cwd / launcher_pid (and `cuda` for MVAPICH) for tests."""
    name = args.launcher.lower()
    if name not in LAUNCHER_CLASSES:
        raise LaunchError(f"--launcher {args.launcher!r}: expected one of {', '.join(LAUNCHER_CLASSES)}")
    cls = LAUNCHER_CLASSES[name]
    cls.validate_active_resources(active)
    world_info = encode_world_info(active)
    extra = {"cuda": facts.pop("cuda")} if cls is MVAPICHRunner and "cuda" in facts else {}
    runner = cls(args, world_info) if cls is PDSHRunner else cls(args, world_info, pool, **extra)  # type: ignore
    for key, value in facts.items():
        setattr(runner, key, value)
    return runner


def build_backend_job(runner: MultiNodeRunner, active: Mapping[str, Sequence[int]], env: Mapping[str, str],
                      env_files: Sequence[tuple[str, str]], accelerator_prefixes: Sequence[str] = ()) -> BackendJob:
    """The command and environment that start the job (the working directory joins PYTHONPATH)."""
    env = dict(env)
    env["PYTHONPATH"] = runner.cwd + (":" + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    for key, value in collect_exports(env, env_files, accelerator_prefixes):
        runner.add_export(key, value)
    if isinstance(runner, PDSHRunner):
        cmd, kill, env = runner.get_cmd(env, active)
        return BackendJob(runner.name, tuple(cmd), env, tuple(kill))
    return BackendJob(runner.name, tuple(runner.get_cmd(env, active)), env)


def ssh_check_cmd(host: str, ssh_port: int | None) -> list[str]:
    return ["ssh", "-o", "PasswordAuthentication=no"] + (["-p", str(ssh_port)] if ssh_port else []) + [host, "hostname"]


def hostname_cmd(host: str, ssh_port: int | None) -> list[str]:
    return ["ssh"] + (["-p", str(ssh_port)] if ssh_port else []) + [host, "hostname", "-I"]


# --------------------------------------------------------------------------- impure parts


def read_env_files(paths: Sequence[str] = DEEPSPEED_ENVIRONMENT_PATHS,
                   name: str = DEEPSPEED_ENVIRONMENT_NAME) -> list[tuple[str, str]]:
    """(path, text) of the .deepspeed_env files in the home and working directories."""
    files = []
    for directory in paths:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as fd:
                files.append((path, fd.read()))
    return files


def check_ssh(host: str, ssh_port: int | None, hostfile: str) -> None:
    try:
        subprocess.check_call(ssh_check_cmd(host, ssh_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise LaunchError(f"--hostfile {hostfile}: host {host!r} is not reachable with passwordless ssh "
                          f"(`{shlex.join(ssh_check_cmd(host, ssh_port))}` failed). Set up ssh keys, pass "
                          "--no_ssh_check, or start each node yourself with --no_ssh --node_rank N") from None


def detect_master_addr(host: str, ssh_port: int | None) -> str:
    """The first address `hostname -I` reports on `host` (upstream's default --master_addr)."""
    cmd = hostname_cmd(host, ssh_port)
    try:
        out = subprocess.check_output(cmd, stderr=subprocess.DEVNULL).decode().split()
    except (subprocess.CalledProcessError, FileNotFoundError):
        out = []
    if not out:
        raise LaunchError(f"--master_addr: could not detect {host}'s address with `{shlex.join(cmd)}`; "
                          "pass --master_addr")
    return out[0]


def run_backend(job: BackendJob, say) -> int:
    """Run the tool, forward signals to it, and return its exit code (128+N for signal N)."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in FORWARDED}
    try:
        proc = subprocess.Popen(list(job.cmd), env=dict(job.env))
        handled = 0
        while proc.poll() is None:
            if len(received) > handled:
                handled = len(received)
                _forward(job, proc, received[-1], say)
            time.sleep(0.05)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    code = proc.returncode
    if received:
        return 128 + received[0]
    return 128 - code if code < 0 else code


def _forward(job: BackendJob, proc: subprocess.Popen, signum: int, say) -> None:
    name = signal.Signals(signum).name
    if job.kill_cmd is None:
        say(f"received {name}; forwarding it to {job.launcher}")
        proc.send_signal(signum)
        return
    # pdsh's remote commands survive a killed pdsh (no tty): stop pdsh, then pkill launch.py on every host.
    say(f"received {name}; stopping pdsh and the launchers on every host")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        subprocess.run(list(job.kill_cmd), env=dict(job.env), timeout=KILL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        say(f"the kill command failed ({exc}); processes may be left on the hosts")


def launch_multinode(args: Any, active: Mapping[str, Sequence[int]], pool: Mapping[str, int], *,
                     cuda: bool, say) -> int:
    """Everything upstream's runner.main does for a multi-node job, then run it."""
    runner = make_runner(args, active, pool)
    if not runner.backend_exists():
        tool = {"pdsh": "pdsh", "openmpi": "ompi_info", "slurm": "sinfo", "mvapich": "mpiname"}.get(runner.name,
                                                                                                    "mpirun")
        raise LaunchError(f"--launcher {runner.name}: `{tool}` is not installed (not found on PATH); install it or "
                          "choose another --launcher (pdsh, openmpi, mpich, impi, mvapich, slurm)")
    first = next(iter(active))
    if not args.no_ssh_check:
        check_ssh(first, args.ssh_port, args.hostfile)
    if not args.master_addr:
        args.master_addr = detect_master_addr(first, args.ssh_port)
        say(f"using {args.master_addr} (`hostname -I` on {first}) as --master_addr")
    job = build_backend_job(runner, active, os.environ, read_env_files(), ["NCCL"] if cuda else [])
    say(f"cmd = {shlex.join(job.cmd)}")
    sys.stdout.flush()
    return run_backend(job, say)
