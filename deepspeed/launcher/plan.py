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

import base64
import json
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torch.distributed's default, as upstream
MULTI_NODE_UNSUPPORTED = (
    "multi-node launch is not supported yet by this implementation; use torchrun/srun per node "
    "(or run `python -m deepspeed.launcher.launch --world_info=... --node_rank=N` on each node)"
)
NODE_SPEC_FORMAT = "NAME[:SLOT[,SLOT...]][@NAME[:SLOT...]...], e.g. 'localhost:0,1'"


class LaunchError(ValueError):
    """A launch request that cannot be satisfied; the message names the flag, value and fix."""


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


# --------------------------------------------------------------------------- resource strings


def parse_hostfile(lines: Sequence[str], path: str = "hostfile") -> "OrderedDict[str, int]":
    """MPI-style `host slots=N` lines (comments and blank lines skipped) -> {host: slots}."""
    pool: OrderedDict[str, int] = OrderedDict()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)\s*$", line)
        if not match:
            raise LaunchError(f"{path}:{lineno}: bad hostfile line {line!r}; expected 'HOST slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(f"{path}:{lineno}: host {host!r} is listed twice")
        pool[host] = slots
    if not pool:
        raise LaunchError(f"{path}: hostfile has no 'HOST slots=N' entries")
    return pool


def parse_node_spec(flag: str, value: str) -> "OrderedDict[str, list[int]]":
    """Parse an --include/--exclude string into {host: sorted slots} ([] means 'all slots')."""
    spec: OrderedDict[str, list[int]] = OrderedDict()
    for part in value.split("@"):
        host, sep, slot_text = part.partition(":")
        if not host.strip():
            raise LaunchError(f"{flag} {value!r}: empty host name; expected {NODE_SPEC_FORMAT}")
        slots = spec.setdefault(host.strip(), [])
        if not sep:
            continue
        for token in slot_text.split(","):
            if not token.strip().isdigit():
                raise LaunchError(
                    f"{flag} {value!r}: slot {token!r} is not a non-negative integer; expected {NODE_SPEC_FORMAT}"
                )
            slots.append(int(token))
    return OrderedDict((h, sorted(set(s))) for h, s in spec.items())


def filter_resources(
    pool: Mapping[str, Sequence[int]], include: str = "", exclude: str = "", note: str = ""
) -> "OrderedDict[str, list[int]]":
    """Apply --include or --exclude to {host: slots}; keeps hostfile order and drops empty hosts."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; use one of them")
    if not include and not exclude:
        return OrderedDict((h, list(s)) for h, s in pool.items())
    flag, value = ("--include", include) if include else ("--exclude", exclude)
    suffix = f" ({note})" if note else ""
    chosen: dict[str, list[int]] = {}
    for host, slots in parse_node_spec(flag, value).items():
        if host not in pool:
            available = ", ".join(pool)
            raise LaunchError(f"{flag} {value!r}: host {host!r} is not available (available: {available}){suffix}")
        missing = [s for s in slots if s not in pool[host]]
        if missing:
            raise LaunchError(
                f"{flag} {value!r}: slot {missing[0]} does not exist on {host} "
                f"(available slots: {_ranges(pool[host])}){suffix}"
            )
        chosen[host] = slots or list(pool[host])
    if include:
        result = ((h, chosen[h]) for h in pool if h in chosen)
    else:
        result = ((h, [s for s in pool[h] if s not in chosen.get(h, ())]) for h in pool)
    return OrderedDict((h, s) for h, s in result if s)


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


def encode_world_info(nodes: Mapping[str, Sequence[int | str]]) -> str:
    """{host: device ids} -> urlsafe base64 JSON, the `--world_info` format of launch.py."""
    return base64.urlsafe_b64encode(json.dumps({h: list(ids) for h, ids in nodes.items()}).encode()).decode()


def decode_world_info(text: str) -> "OrderedDict[str, list[str]]":
    """Inverse of encode_world_info; device ids come back as strings (they go into an env var)."""
    try:
        raw = json.loads(base64.urlsafe_b64decode(text.encode()), object_pairs_hook=OrderedDict)
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"--world_info {text!r}: not base64-encoded JSON ({exc})") from None
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, list) for v in raw.values()):
        raise LaunchError(f"--world_info decodes to {raw!r}; expected a non-empty {{host: [device ids]}} object")
    return OrderedDict((h, [str(i) for i in ids]) for h, ids in raw.items())


def _ranges(slots: Sequence[int]) -> str:
    if list(slots) == list(range(len(slots))) and slots:
        return f"0-{len(slots) - 1}" if len(slots) > 1 else "0"
    return ",".join(map(str, slots)) or "none"


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
    return LaunchPlan(world_size, master[0], master[1], tuple(ranks), node_rank, len(nodes))


# --------------------------------------------------------------------------- single-node resolution


def resolve_local_devices(
    host: LocalHost,
    hostfile: Mapping[str, int] | None = None,
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    force_multi: bool = False,
) -> list[str]:
    """Pick this node's device ids (CUDA ids, or CPU slot numbers) from the CLI resource flags.

    See [Note: slots index the visible devices]. Anything that would need a second machine
    raises MULTI_NODE_UNSUPPORTED rather than silently launching locally.
    """
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude; use one style")
    for flag, count in (("--num_gpus", num_gpus), ("--num_nodes", num_nodes)):
        if count is not None and count < 1:
            raise LaunchError(f"{flag} {count}: must be >= 1")
    if force_multi or (num_nodes is not None and num_nodes > 1):
        raise LaunchError(MULTI_NODE_UNSUPPORTED)
    devices = host.visible_devices
    if hostfile:
        pool = dict(hostfile)
    elif devices is not None:
        pool = {"localhost": len(devices)}
    else:  # CPU host: one process by default, one virtual slot per core for include/exclude
        pool = {"localhost": num_gpus or (len(host.cpus) if include or exclude else 1)}
    note = _device_note(devices)
    active = filter_resources({h: list(range(n)) for h, n in pool.items()}, include, exclude, note)
    if not active:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to launch on")
    if num_nodes is not None:  # upstream: the first num_nodes hosts of the (filtered) pool
        active = OrderedDict(list(active.items())[:num_nodes])
    if len(active) > 1:
        raise LaunchError(f"{MULTI_NODE_UNSUPPORTED} (resources span {len(active)} hosts: {', '.join(active)})")
    name, slots = next(iter(active.items()))
    if name not in host.names:
        local = ", ".join(sorted(host.names))
        raise LaunchError(f"host {name!r} is not this machine ({local}); {MULTI_NODE_UNSUPPORTED}")
    if num_gpus is not None:
        slots = list(range(num_gpus))
    if devices is None:
        return [str(s) for s in slots]
    too_high = [s for s in slots if s >= len(devices)]
    if too_high:
        flag = f"--num_gpus {num_gpus}" if num_gpus is not None else "hostfile slots"
        raise LaunchError(f"{flag}: asks for slot {too_high[0]} but only {len(devices)} device(s) are visible ({note})")
    return [devices[s] for s in slots]


def _device_note(devices: tuple[str, ...] | None) -> str:
    if devices is None:
        return "CPU-only host: slots are processes, not devices"
    return f"slots index the visible CUDA devices {','.join(devices) or 'none'}"
