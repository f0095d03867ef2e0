# compat: upstream path deepspeed.utils.numa (DeepSpeed 0.19.8 name).
"""Core lists and NUMA binding: `parse_range_list` (upstream's strict reading of a core list such
as "0,2-4,6,8-9") and the `numactl` prefix the Intel MPI runner gives each rank.

The launcher's `--bind_core_list` (deepspeed/launcher/plan.py parse_core_list) keeps any order
and drops repeats; this form requires ascending, disjoint entries, as upstream's, and raises
ValueError otherwise. (Kept apart from the launcher: utils sits below it.)
"""

from __future__ import annotations


def parse_range_list(range_str: str) -> list[int]:
    cores: list[int] = []
    for token in range_str.split(","):
        lo, dash, hi = token.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{range_str!r}: bad entry {token!r}; expected a list like '0,2-5,7'")
        start, end = int(lo), int(hi) if dash else int(lo)
        if end < start:
            raise ValueError(f"{range_str!r}: range {token!r} is in reverse order")
        if cores and start <= cores[-1]:
            raise ValueError(f"{range_str!r}: entry {token!r} overlaps or precedes the one before it; "
                             "give ascending, disjoint entries")
        cores.extend(range(start, end + 1))
    return cores


def get_numa_cores(sysfs: str = "/sys/devices/system/node") -> list[list[int]]:
    """Cores of each NUMA node ([] for a node without cores, e.g. HBM), read from sysfs.

    Upstream parses `numactl --hardware`; the kernel's cpulist files hold the same facts
    without the tool. An unreadable sysfs gives [] (no NUMA information).
    """
    import glob
    import os
    import re

    nodes: dict[int, list[int]] = {}
    for path in glob.glob(os.path.join(sysfs, "node[0-9]*")):
        match = re.search(r"node(\d+)$", path)
        try:
            with open(os.path.join(path, "cpulist")) as fd:
                text = fd.read().strip()
        except OSError:
            continue
        if match:
            nodes[int(match.group(1))] = parse_range_list(text) if text else []
    return [nodes.get(i, []) for i in range(max(nodes) + 1)] if nodes else []


def compress_core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (numactl -C syntax)."""
    parts: list[str] = []
    start = prev = None
    for core in cores + [None]:  # type: ignore[operator]
        if prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = core
    return ",".join(parts)


def numactl_cmd(cores: list[int], numa_cores: list[list[int]]) -> list[str]:
    """`numactl [-m NODE] -C CORES`: bind memory too when every core lies in one NUMA node.

    Upstream also handles flat-HBM (-p) and fake-NUMA (-m a,b) layouts; those are not
    recognised here, so such hosts get CPU binding only.
    """
    cmd = ["numactl"]
    for node, node_cores in enumerate(numa_cores):
        if node_cores and set(cores) <= set(node_cores):
            cmd += ["-m", str(node)]
            break
    return cmd + ["-C", compress_core_list(cores)]


def get_numactl_cmd(bind_core_list: str | None, num_local_procs: int, local_rank: int,
                    numa_cores: list[list[int]] | None = None) -> tuple[int, list[str]]:
    """(cores per rank, numactl command) for one local rank, as upstream's helper of the same name.

    Without `bind_core_list` the physical cores 0..N-1 are split (psutil.cpu_count(logical=False)).
    """
    if bind_core_list is not None:
        core_list = parse_range_list(bind_core_list)
    else:
        import psutil

        core_list = list(range(psutil.cpu_count(logical=False) or 1))
    per_rank = len(core_list) // num_local_procs
    if per_rank < 1:
        raise ValueError(f"--bind_core_list {bind_core_list!r}: {len(core_list)} core(s) cannot be split among "
                         f"{num_local_procs} local ranks; give at least one core per rank")
    mine = core_list[per_rank * local_rank:per_rank * (local_rank + 1)]
    return per_rank, numactl_cmd(mine, get_numa_cores() if numa_cores is None else numa_cores)
