"""Upstream's shard-size helpers (`deepspeed.module_inject.tp_shard`): how a dimension is split over ranks.

Ulysses' uneven head split and upstream's own tests import these. The rule, as upstream: with a kv-head
count registered, dimensions that are a multiple of it (attention projections) split by whole kv heads,
the first `heads % ranks` ranks taking one more; otherwise the split is near-even in grains of 64 elements
(in single elements below 64; a dimension of 64 or more is taken to be a multiple of 64, as upstream), the
first ranks taking the remainder.
"""

from __future__ import annotations

from typing import Optional

_LAST_LINEAR = ("lm_head", "embed_out")
num_kv_heads: Optional[int] = None


def set_num_kv_heads(num: Optional[int]) -> None:
    global num_kv_heads
    num_kv_heads = num


def get_num_kv_heads() -> Optional[int]:
    return num_kv_heads


def _near_even(units: int, parts: int, rank: int) -> int:
    return units // parts + (1 if rank < units % parts else 0)


def get_shard_size(total_size: int, mp_size: int, name: Optional[str] = None, rank: Optional[int] = None) -> int:
    """Rank `rank`'s share of a dimension of `total_size` split over `mp_size` ranks."""
    if rank is None:
        from .. import comm as dist

        rank = dist.get_rank()
    heads = num_kv_heads
    if heads is not None and total_size % heads == 0 and "mlp" not in str(name) and str(name) not in _LAST_LINEAR:
        return total_size // heads * _near_even(heads, mp_size, rank)
    if total_size >= 64:
        return _near_even(total_size // 64, mp_size, rank) * 64
    return _near_even(total_size, mp_size, rank)


def get_shard_size_list(total_size: int, mp_size: int, name: Optional[str] = None) -> list[int]:
    """Every rank's share, in rank order."""
    return [get_shard_size(total_size, mp_size, name, rank) for rank in range(mp_size)]
