"""Pure resource arithmetic of the `deepspeed` launcher: hostfiles, --include/--exclude,
--num_nodes/--num_gpus, and the base64 `--world_info` handed to each node.

The rules follow DeepSpeed 0.19.8's runner (`_parse_hostfile`, `parse_resource_filter`,
`apply_num_nodes_and_gpus`, `encode_world_info`); where upstream crashes or silently accepts
nonsense, the error here names the flag or file line, the value and what is allowed.
Nothing here starts a process or imports torch.
"""

from __future__ import annotations

import sys

import os

import base64
import json
import re
from collections import OrderedDict
from typing import Mapping, Sequence


class LaunchError(ValueError):
    """A launch request that cannot be satisfied; the message names the flag, value and fix."""


NODE_SPEC_FORMAT = "NAME[:SLOT[,SLOT...]][@NAME[:SLOT...]...], e.g. 'worker-0:0,1@worker-1'"
# `host slots=N`, optionally followed by other `key=value` fields (OpenMPI's max_slots=) or a comment.
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)((?:\s+[\w-]+=\S*)*)\s*(?:#.*)?$")

Resources = "OrderedDict[str, list[int]]"


def parse_hostfile(lines: Sequence[str], path: str = "hostfile") -> "OrderedDict[str, int]":
    """MPI-style `host slots=N` lines (comments and blank lines skipped) -> {host: slots}, in order."""
    pool: OrderedDict[str, int] = OrderedDict()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if not match:
            raise LaunchError(f"{path}:{lineno}: bad hostfile line {line!r}; expected 'HOST slots=N' "
                              "(e.g. 'worker-0 slots=8')")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(f"{path}:{lineno}: host {host!r} is listed twice (first with slots={pool[host]}); "
                              "list each host once")
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
                f"(available slots: {ranges(pool[host])}){suffix}"
            )
        chosen[host] = slots or list(pool[host])
    if include:
        result = ((h, chosen[h]) for h in pool if h in chosen)
    else:
        result = ((h, [s for s in pool[h] if s not in chosen.get(h, ())]) for h in pool)
    return OrderedDict((h, s) for h, s in result if s)


def check_counts(num_nodes: int | None, num_gpus: int | None, include: str = "", exclude: str = "") -> None:
    """--num_nodes/--num_gpus: positive, and not mixed with --include/--exclude (as upstream)."""
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude; use one style")
    for flag, count in (("--num_gpus", num_gpus), ("--num_nodes", num_nodes)):
        if count is not None and count < 1:
            raise LaunchError(f"{flag} {count}: must be >= 1")


def select_resources(
    pool: Mapping[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> "OrderedDict[str, list[int]]":
    """{host: slot count} -> the {host: slot ids} a job uses: filter, then the first num_nodes hosts,
    then slots 0..num_gpus-1 on each (upstream's order). Never empty."""
    check_counts(num_nodes, num_gpus, include, exclude)
    active = filter_resources({h: list(range(n)) for h, n in pool.items()}, include, exclude)
    if not active:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to launch on")
    if num_nodes is not None:
        if num_nodes > len(active):
            raise LaunchError(f"--num_nodes {num_nodes}: only {len(active)} host(s) are available "
                              f"({', '.join(active)})")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        short = [h for h in active if pool[h] < num_gpus]
        if short:
            raise LaunchError(f"--num_gpus {num_gpus}: host {short[0]!r} has only {pool[short[0]]} slot(s) "
                              "in the hostfile")
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    return active


def encode_world_info(nodes: Mapping[str, Sequence[int | str]]) -> str:
    """{host: device ids} -> urlsafe base64 JSON, the `--world_info` format of launch.py."""
    return base64.urlsafe_b64encode(json.dumps(dict(nodes), default=list).encode()).decode()


def decode_world_info(text: str) -> "OrderedDict[str, list[str]]":
    """Inverse of encode_world_info; device ids come back as strings (they go into an env var)."""
    try:
        raw = json.loads(base64.urlsafe_b64decode(text.encode()), object_pairs_hook=OrderedDict)
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"--world_info {text!r}: not base64-encoded JSON ({exc})") from None
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, list) for v in raw.values()):
        raise LaunchError(f"--world_info decodes to {raw!r}; expected a non-empty {{host: [device ids]}} object")
    return OrderedDict((h, [str(i) for i in ids]) for h, ids in raw.items())


def ranges(slots: Sequence[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; anything else comma-separated."""
    if list(slots) == list(range(len(slots))) and slots:
        return f"0-{len(slots) - 1}" if len(slots) > 1 else "0"
    return ",".join(map(str, slots)) or "none"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[03-05,9],cpu1' -> 'gpu03', 'a[1-2]b[7]' -> 'a1b7'."""
    out, depth, i = [], 0, 0
    while i < len(nodelist):
        ch = nodelist[i]
        if ch == "," and depth == 0:
            break
        if ch == "[":
            end = nodelist.index("]", i)
            first = nodelist[i + 1:end].split(",")[0].split("-")[0]
            out.append(first)
            i = end + 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


# Device nodes / proc entries a CUDA or ROCm driver creates; without any, torch sees 0 devices.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_device_count() -> int:
    """torch.cuda.device_count(), skipping the multi-second torch import on hosts with no GPU driver."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
