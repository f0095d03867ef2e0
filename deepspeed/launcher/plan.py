"""Pure launch planning: resource strings and hostfiles in, a frozen `LaunchPlan` out.

Nothing here starts a process, opens a socket or imports torch, so every rule of the
`deepspeed` CLI (include/exclude filters, CUDA_VISIBLE_DEVICES mapping, per-rank env and
command lines) is unit-tested without a GPU. `runner.py` gathers the facts about the host
and `launch.py` executes the plan. See docs/launcher.md.

[Note: slots index the visible devices]
Upstream DeepSpeed deletes CUDA_VISIBLE_DEVICES as soon as --include/--exclude/--num_gpus is
given and then treats slot ids as physical GPU ids (ANCHORS pain point 17). Here a slot is
always an index into the list of devices this process can see: with
CUDA_VISIBLE_DEVICES=2,3, `--include localhost:1` launches on physical GPU 3. Like upstream,
every local rank gets CUDA_VISIBLE_DEVICES set to the selected devices and picks its own
with LOCAL_RANK (torch.cuda.set_device(local_rank)).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

# compat: these lived here before the multi-node launcher; tests and callers import them from plan.
from .resources import (  # noqa: F401
    NODE_SPEC_FORMAT,
    LaunchError,
    check_counts,
    decode_world_info,
    encode_world_info,
    filter_resources,
    parse_hostfile,
    parse_node_spec,
    ranges,
)

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torch.distributed's default, as upstream


@dataclass(frozen=True)
class RankLaunch:
    """Everything needed to start one rank: its command line and the env vars it adds."""

    global_rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # only the variables the launcher sets; merged over os.environ
    cpu_cores: tuple[int, ...] | None = None  # --bind_cores_to_rank
    log_path: str | None = None  # --enable_each_rank_log


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks one node starts, plus the rendezvous address they share."""

    world_size: int
    master_addr: str
    master_port: int
    ranks: tuple[RankLaunch, ...]
    node_rank: int = 0
    num_nodes: int = 1
    host: str = "localhost"  # this node's name in the world info (for messages)

    @property
    def envs(self) -> tuple[Mapping[str, str], ...]:
        return tuple(r.env for r in self.ranks)

    @property
    def argvs(self) -> tuple[tuple[str, ...], ...]:
        return tuple(r.argv for r in self.ranks)


@dataclass(frozen=True)
class ScriptSpec:
    """How to run the user's program (the part of the CLI after the launcher flags)."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise LaunchError("--module and --no_python cannot be used together: --module means `python -m SCRIPT`")


@dataclass(frozen=True)
class LocalHost:
    """Facts about the machine the launcher runs on, gathered by runner.discover_local_host()."""

    visible_devices: tuple[str, ...] | None  # CUDA devices this process sees; None on a CPU-only host
    cpus: tuple[int, ...] = (0,)  # cores in our affinity mask (--bind_cores_to_rank)
    names: frozenset[str] = frozenset({"localhost", "127.0.0.1"})


# --------------------------------------------------------------------------- cores


def parse_core_list(text: str, flag: str = "--bind_core_list") -> list[int]:
    """'1,3-5,7' -> [1, 3, 4, 5, 7] (order kept, duplicates dropped)."""
    cores: list[int] = []
    for token in text.split(","):
        lo, dash, hi = token.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise LaunchError(f"{flag} {text!r}: bad entry {token!r}; expected a list like '0,2-5,7'")
        span = range(int(lo), int(hi) + 1) if dash else [int(lo)]
        if not span:
            raise LaunchError(f"{flag} {text!r}: empty range {token!r}")
        cores.extend(c for c in span if c not in cores)
    return cores


def split_cores(cores: Sequence[int], nprocs: int) -> list[tuple[int, ...]]:
    """Give each local rank an equal, disjoint block of cores (leftover cores stay unused)."""
    per_rank = len(cores) // nprocs
    if per_rank == 0:
        raise LaunchError(
            f"--bind_cores_to_rank: {len(cores)} core(s) cannot be split among {nprocs} local ranks; "
            "pass --bind_core_list with more cores or launch fewer ranks"
        )
    return [tuple(cores[i * per_rank : (i + 1) * per_rank]) for i in range(nprocs)]


# --------------------------------------------------------------------------- per-rank plan


def rank_argv(spec: ScriptSpec, local_rank: int) -> tuple[str, ...]:
    """Command line of one rank; `--local_rank=N` goes first after the script, as upstream."""
    if spec.no_python:
        argv = [spec.script]
    else:
        argv = [spec.python, "-u", *(["-m"] if spec.module else []), spec.script]
    if not spec.no_local_rank:
        argv.append(f"--local_rank={local_rank}")
    return tuple(argv + list(spec.args))


def build_node_plan(
    spec: ScriptSpec,
    nodes: Sequence[Sequence[str]],
    *,
    node_rank: int = 0,
    master: tuple[str, int] = (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT),
    visible_devices: bool = True,
    cores: Sequence[int] | None = None,
    log_dir: str | None = None,
    host: str = "localhost",
) -> LaunchPlan:
    """Plan the ranks of node `node_rank`; `nodes[i]` lists node i's device ids in rank order.

    Global ranks are numbered node by node, so every node computes the same mapping from
    the same `nodes`. `visible_devices=False` (CPU hosts) leaves CUDA_VISIBLE_DEVICES alone.
    """
    if not 0 <= node_rank < len(nodes):
        raise LaunchError(f"--node_rank {node_rank}: must be in [0, {len(nodes)}) for {len(nodes)} node(s)")
    local_ids = list(nodes[node_rank])
    if not local_ids:
        raise LaunchError(f"node {node_rank} has no devices to launch on")
    first_rank = sum(len(n) for n in nodes[:node_rank])
    world_size = sum(len(n) for n in nodes)
    core_blocks = split_cores(cores, len(local_ids)) if cores is not None else None
    shared = {
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(len(local_ids)),
        "LOCAL_SIZE": str(len(local_ids)),  # upstream's name for the same value
        "CROSS_RANK": str(node_rank),
        "CROSS_SIZE": str(len(nodes)),
    }
    if visible_devices:
        shared["CUDA_VISIBLE_DEVICES"] = ",".join(local_ids)
    ranks = []
    for local_rank in range(len(local_ids)):
        rank = first_rank + local_rank
        env = dict(shared, RANK=str(rank), LOCAL_RANK=str(local_rank))
        block = core_blocks[local_rank] if core_blocks else None
        if block:
            env["OMP_NUM_THREADS"] = str(len(block))
        log_path = f"{log_dir.rstrip('/')}/rank{rank}.log" if log_dir else None
        ranks.append(RankLaunch(rank, local_rank, rank_argv(spec, local_rank), MappingProxyType(env), block, log_path))
    return LaunchPlan(world_size, master[0], master[1], tuple(ranks), node_rank, len(nodes), host)


# --------------------------------------------------------------------------- a node of a multi-node job

CONTROL_PORT_ENV = "DS_LAUNCHER_CONTROL_PORT"
RDZV_TIMEOUT_ENV = "DS_LAUNCHER_RENDEZVOUS_TIMEOUT"
DEFAULT_RDZV_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class LinkSpec:
    """Where and how this node's launcher meets the others (see node_link.py, [Note: node link])."""

    node_rank: int
    hosts: tuple[str, ...]  # node names in node-rank order (from the world info)
    addr: str
    port: int
    timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    token: str = ""  # identifies the job: launchers of another job are turned away
    min_nodes: int | None = None  # elastic start: start with at least this many nodes at the timeout
    max_nodes: int | None = None  # elastic start: start as soon as this many nodes joined

    def label(self, node_rank: int) -> str:
        return f"node rank {node_rank} ({self.hosts[node_rank]})"


@dataclass(frozen=True)
class NodeJob:
    """This node's share of a job described by a world info: its plan and, with more than one
    node, its link to the other launchers."""

    spec: ScriptSpec
    hosts: tuple[str, ...]
    devices: tuple[tuple[str, ...], ...]  # per node, in node-rank order
    node_rank: int
    master: tuple[str, int]
    visible_devices: bool = True
    cores: tuple[int, ...] | None = None
    log_dir: str | None = None
    link: LinkSpec | None = None

    @property
    def plan(self) -> LaunchPlan:
        return self.plan_for(range(len(self.hosts)))

    def plan_for(self, node_ranks: Sequence[int]) -> LaunchPlan:
        """The plan when only `node_ranks` take part (an elastic start), renumbered in order."""
        node_ranks = list(node_ranks)
        return build_node_plan(self.spec, [self.devices[r] for r in node_ranks],
                               node_rank=node_ranks.index(self.node_rank), master=self.master,
                               visible_devices=self.visible_devices, cores=self.cores, log_dir=self.log_dir,
                               host=self.hosts[self.node_rank])


def job_token(world_info: str, script: str) -> str:
    """Same world info and script on every node -> same token (node 0 turns other jobs away)."""
    return hashlib.sha256(f"{world_info}\0{script}".encode()).hexdigest()[:16]


def env_int(env: Mapping[str, str], names: Sequence[str], what: str) -> int | None:
    """The first of `names` set in `env`, as an int (a scheduler's NODE_RANK, MASTER_PORT, ...)."""
    for name in names:
        raw = env.get(name)
        if raw:
            if not raw.strip().isdigit():
                raise LaunchError(f"{name}={raw!r} ({what}): expected a non-negative integer")
            return int(raw)
    return None


def link_settings(master_port: int, env: Mapping[str, str]) -> tuple[int, float]:
    """(control port, rendezvous timeout) from DS_LAUNCHER_CONTROL_PORT / DS_LAUNCHER_RENDEZVOUS_TIMEOUT."""
    port = env_int(env, [CONTROL_PORT_ENV], "the launchers' control port")
    if port is not None and not 0 < port < 65536:
        raise LaunchError(f"{CONTROL_PORT_ENV}={port}: expected a TCP port number (1-65535)")
    raw = env.get(RDZV_TIMEOUT_ENV)
    try:
        timeout = float(raw) if raw else DEFAULT_RDZV_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if timeout <= 0:
        raise LaunchError(f"{RDZV_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return (master_port + 1 if port is None else port), timeout


def elastic_bounds(min_nodes: int | None, max_nodes: int | None, num_nodes: int) -> tuple[int | None, int | None]:
    """--min_elastic_nodes/--max_elastic_nodes (-1 or None: unset) checked against the node count."""
    lo = None if min_nodes is None or min_nodes < 0 else min_nodes
    hi = None if max_nodes is None or max_nodes < 0 else max_nodes
    if lo is not None and not 1 <= lo <= num_nodes:
        raise LaunchError(f"--min_elastic_nodes {lo}: must be between 1 and the number of nodes ({num_nodes})")
    if hi is not None and not 1 <= hi:
        raise LaunchError(f"--max_elastic_nodes {hi}: must be >= 1")
    if lo is not None and hi is not None and hi < lo:
        raise LaunchError(f"--max_elastic_nodes {hi} is smaller than --min_elastic_nodes {lo}")
    return lo, hi


def node_job(spec: ScriptSpec, world: Mapping[str, Sequence[str]], node_rank: int, master: tuple[str, int], *,
             env: Mapping[str, str], token: str = "", elastic: tuple[int | None, int | None] = (None, None),
             **plan_options) -> NodeJob:
    """This node's NodeJob for the {host: device ids} world; a LinkSpec when there is more than one node."""
    hosts = tuple(world)
    if not 0 <= node_rank < len(hosts):
        raise LaunchError(f"--node_rank {node_rank}: must be in [0, {len(hosts)}) for the {len(hosts)} node(s) "
                          f"{', '.join(hosts)}")
    link = None
    if len(hosts) > 1:
        port, timeout = link_settings(master[1], env)
        lo, hi = elastic_bounds(*elastic, len(hosts))
        link = LinkSpec(node_rank, hosts, master[0], port, timeout, token, lo, hi)
    devices = tuple(tuple(str(d) for d in ids) for ids in world.values())
    job = NodeJob(spec, hosts, devices, node_rank, master, link=link, **plan_options)
    job.plan  # noqa: B018 - validate now (cores per rank, empty nodes), before anything starts
    return job


# --------------------------------------------------------------------------- single-node resolution


def resolve_local_devices(
    host: LocalHost,
    *,
    include: str = "",
    exclude: str = "",
    num_gpus: int | None = None,
) -> list[str]:
    """No hostfile: pick this machine's device ids (CUDA ids, or CPU slot numbers) from the flags.

    A CUDA host offers one slot per visible device; a CPU host one process by default, N with
    --num_gpus N, and one virtual slot per core for --include/--exclude.
    See [Note: slots index the visible devices].
    """
    check_counts(None, num_gpus, include, exclude)
    devices = host.visible_devices
    if devices is not None:
        count = len(devices)
    else:
        count = num_gpus or (len(host.cpus) if include or exclude else 1)
    note = _device_note(devices)
    active = filter_resources({"localhost": list(range(count))}, include, exclude, note)
    if not active:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to launch on")
    slots = list(range(num_gpus)) if num_gpus is not None else active["localhost"]
    return map_local_slots(host, slots, f"--num_gpus {num_gpus}" if num_gpus is not None else "--include")


def map_local_slots(host: LocalHost, slots: Sequence[int], what: str = "hostfile slots") -> list[str]:
    """Slot numbers on this machine -> device ids (an index into the visible CUDA devices)."""
    devices = host.visible_devices
    if devices is None:
        return [str(s) for s in slots]
    too_high = [s for s in slots if s >= len(devices)]
    if too_high:
        raise LaunchError(f"{what}: asks for slot {too_high[0]} but only {len(devices)} device(s) are visible "
                          f"({_device_note(devices)})")
    return [devices[s] for s in slots]


def _device_note(devices: tuple[str, ...] | None) -> str:
    if devices is None:
        return "CPU-only host: slots are processes, not devices"
    return f"slots index the visible CUDA devices {','.join(devices) or 'none'}"
