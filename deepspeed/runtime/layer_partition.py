"""Splitting a sequence of weighted items (layers, elements) into contiguous parts.

`partition_uniform` balances item counts; `partition_balanced` minimises the heaviest part's
weight (the slowest pipeline stage). Both return part boundaries: P + 1 non-decreasing indices
from 0 to the item count, part p being items [bounds[p], bounds[p + 1]). Pure functions.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Optional, Sequence


def prefix_sum_inc(weights: Sequence[float]) -> list:
    """Inclusive running sums: [w0, w0 + w1, ...]."""
    sums, total = [], 0
    for w in weights:
        total += w
        sums.append(total)
    return sums


def _check_parts(num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Item counts differ by at most one between parts, the first parts taking the extra items
    (with fewer items than parts, the last parts are empty)."""
    _check_parts(num_parts)
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def _pack(prefix: list, cap: float, num_parts: int, tol: float) -> Optional[list[int]]:
    """Greedy left-to-right packing with every part's weight <= cap, leaving at least one item for
    each remaining part while items remain; None when num_parts parts do not suffice."""
    n = len(prefix) - 1
    bounds = [0]
    while bounds[-1] < n:
        if len(bounds) > num_parts:
            return None
        start = bounds[-1]
        end = bisect_right(prefix, prefix[start] + cap + tol, lo=start) - 1
        if end <= start:    # one item heavier than cap
            return None
        parts_left = num_parts - len(bounds)
        bounds.append(max(start + 1, min(end, n - parts_left)))
    return bounds + [n] * (num_parts + 1 - len(bounds))


def _fit(prefix: list, low: float, cap: float, num_parts: int, tol: float) -> Optional[list[int]]:
    """Exactly num_parts non-empty parts, each weighing within [low, cap]; None if impossible.
    reach[i] is the bitmask of part counts that split items [0, i); the valid starts j of a last
    part ending at i form a window [a, b] that only moves right, so per-count tallies over the
    window give reach in O(items x parts)."""
    n = len(prefix) - 1
    full = (1 << (num_parts + 1)) - 1
    reach = [1] + [0] * n
    tally = [0] * (num_parts + 1)
    a = b = 0                        # window [a, b) of starts j
    for i in range(1, n + 1):
        while b < i and prefix[i] - prefix[b] >= low - tol:   # part [b, i) heavy enough: enters
            for c in range(num_parts + 1):
                tally[c] += reach[b] >> c & 1
            b += 1
        while a < b and prefix[i] - prefix[a] > cap + tol:    # too heavy from a on: leaves
            for c in range(num_parts + 1):
                tally[c] -= reach[a] >> c & 1
            a += 1
        reach[i] = sum(1 << (c + 1) for c in range(num_parts) if tally[c]) & full
    if not reach[n] >> num_parts & 1:
        return None
    bounds, i = [n], n
    for c in range(num_parts, 0, -1):   # walk back: the latest start that still leaves c - 1 parts
        j = next(j for j in range(i - 1, -1, -1)
                 if low - tol <= prefix[i] - prefix[j] <= cap + tol and reach[j] >> (c - 1) & 1)
        bounds.append(j)
        i = j
    return bounds[::-1]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries minimising the largest part weight (weights must be >= 0), then, among those,
    maximising the lightest part (the stages as even as they can be). The optimum is one of the
    contiguous-run sums, found by binary search over them (a greedy check for the largest, a
    window DP for the lightest); no part is left empty while there are at least as many items."""
    _check_parts(num_parts)
    if any(w < 0 for w in weights):
        raise ValueError("partition_balanced: weights must be non-negative")
    prefix = [0] + prefix_sum_inc(weights)
    n = len(weights)
    if n == 0:
        return [0] * (num_parts + 1)
    tol = 1e-9 * max(1.0, abs(float(prefix[-1])))
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1        # the whole sequence as one part always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if _pack(prefix, candidates[mid], num_parts, tol) is not None:
            hi = mid
        else:
            lo = mid + 1
    cap = candidates[lo]
    bounds = _pack(prefix, cap, num_parts, tol)
    assert bounds is not None
    if n < num_parts:
        return bounds                      # some parts must stay empty
    lows = [0] + [c for c in candidates if c <= cap + tol]
    lo, hi = 0, len(lows) - 1              # lows[0] = 0 always fits (bounds above)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fit(prefix, lows[mid], cap, num_parts, tol) is not None:
            lo = mid
        else:
            hi = mid - 1
    return _fit(prefix, lows[lo], cap, num_parts, tol) or bounds
