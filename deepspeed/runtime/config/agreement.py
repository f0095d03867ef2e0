"""What of a resolved config every rank must share, its digest, and how ranks' configs differ.

Pure functions (no process group): runtime/agreement.py runs the collective.

[Note: cross-rank config agreement]
Every rank reads its own config (a file per node, a dict built from the rank's arguments), and
nothing made them agree: a rank with another `train_micro_batch_size_per_gpu` trained a batch
neither config describes, and another ZeRO stage failed later with an unrelated message. So the
resolved config (validated, "auto" dropped for defaults, batch triple resolved) is agreed
before the first collective that depends on it: each rank hashes its `agreement_view`, one small
all-reduce tells whether the digests differ, and only then every rank's view is gathered and
every rank raises `ConfigMismatchError` naming the differing keys with each rank's value.
Comparing resolved values (not the text) makes equivalent spellings agree: key order, aliases,
"auto" against the default it stands for, 1 against 1.0, a batch size given against the same
size derived, "adamw" against "AdamW".

The keys in PER_RANK_KEYS may legitimately differ between ranks and are not compared: each is
read only on the rank (or node) that uses it and changes neither values nor collectives.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

PER_RANK_KEYS: dict[str, str] = {
    "tensorboard.output_path": "a directory on the writing node (monitors write from rank 0 only)",
    "csv_monitor.output_path": "a directory on the writing node (monitors write from rank 0 only)",
    "flops_profiler.output_file": "a file on the writing node (the profile is written by rank 0 only)",
    "comet.api_key": "a credential: never exchanged between ranks nor printed (Comet logs from rank 0 only)",
    "zero_optimization.offload_param.nvme_path": "a node-local NVMe mount",
    "zero_optimization.offload_optimizer.nvme_path": "a node-local NVMe mount",
    "aio": "tuning of the node's own asynchronous I/O (block size, queue depth, threads): local speed only",
}

ABSENT = "(absent)"
_MAX_KEYS_SHOWN = 20
_MAX_VALUE_CHARS = 80


def canonical(value: Any) -> Any:
    """A JSON value in one spelling: an integral float as an int (1.0 and 1 configure the same),
    tuples as lists, mapping keys as strings."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return str(value)


def agreement_view(resolved: dict[str, Any], per_rank: Iterable[str] = PER_RANK_KEYS) -> dict[str, Any]:
    """The resolved config (`DeepSpeedConfig.to_dict()`) in canonical form, less the per-rank keys."""
    view = canonical(resolved)
    for dotted in per_rank:
        *parents, leaf = dotted.split(".")
        node = view
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return view


def digest(view: dict[str, Any]) -> int:
    """A 62-bit digest of a view (key order does not matter): fits a signed int64 and its negation."""
    text = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


def diff_configs(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every leaf that differs; a key missing on one side
    is ABSENT there. Dicts are descended into; any other values (lists included) are leaves."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in list(a) + [k for k in b if k not in a]:
            path = f"{prefix}.{key}" if prefix else str(key)
            out += diff_configs(a.get(key, ABSENT), b.get(key, ABSENT), path)
        return out
    return [] if a == b and type(a) is type(b) or _same_number(a, b) else [(prefix or "(root)", a, b)]


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
            and not isinstance(b, bool) and a == b)


def differences(views: dict[int, dict[str, Any]]) -> dict[str, dict[int, Any]]:
    """{dotted key: {rank: value}} for every key on which some rank differs from the lowest rank."""
    ranks = sorted(views)
    reference = views[ranks[0]]
    keys: dict[str, None] = {}
    for rank in ranks[1:]:
        keys.update((key, None) for key, _, _ in diff_configs(reference, views[rank]))
    return {key: {rank: _lookup(views[rank], key) for rank in ranks} for key in keys}


def _lookup(view: Any, dotted: str) -> Any:
    node = view
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def describe(diff: dict[str, dict[int, Any]]) -> list[str]:
    """One line per differing key, ranks with the same value grouped:
    `train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8` or `...: ranks 0, 2-3 = 4, rank 1 = 8`."""
    lines = []
    for key, by_rank in list(diff.items())[:_MAX_KEYS_SHOWN]:
        groups: dict[str, list[int]] = {}
        for rank, value in by_rank.items():
            groups.setdefault(_show(value), []).append(rank)
        shown = ", ".join(f"{'ranks' if len(r) > 1 else 'rank'} {_ranges(r)} = {v}" for v, r in groups.items())
        lines.append(f"{key}: {shown}")
    if len(diff) > _MAX_KEYS_SHOWN:
        lines.append(f"... and {len(diff) - _MAX_KEYS_SHOWN} more keys")
    return lines


def _show(value: Any) -> str:
    text = value if value is ABSENT else json.dumps(value, sort_keys=True)
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS - 3] + "..."


def _ranges(ranks: list[int]) -> str:
    """[0, 2, 3, 4, 7] -> "0, 2-4, 7"."""
    parts: list[str] = []
    start = prev = ranks[0]
    for rank in ranks[1:] + [None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ", ".join(parts)
