# compat: upstream path deepspeed.utils.numa (DeepSpeed 0.19.8 name).
"""`parse_range_list`: upstream's strict reading of a core list such as "0,2-4,6,8-9".

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
