"""Top-1 / top-2 / top-k gating with expert capacity (GShard, Switch), upstream's semantics.

Each gating function decides, for the S tokens of this rank, which experts every token goes to, the
slot ("location") it takes in that expert's buffer of `capacity` rows, and the weight its expert
output gets when combined back. It returns upstream's dense form
`(l_aux, combine_weights[S, E, C], dispatch_mask[S, E, C], exp_counts[E])`, upstream's sparse form with
`sparse_routes=True`, or (`routes=True`, what `MOELayer` uses) the `Routes` both are built from.

[Note: gating equals DeepSpeed 0.19.8]
For the same logits and RNG state the routes, capacity, l_aux and exp_counts are bit-equal to
DeepSpeed 0.19.8's (tests/unit/test_moe_gating.py against tests/fixtures/moe/): every value is
produced by the same elementwise float ops in the same order (softmax, products with 0/1 masks,
one division), integer cumsums, and torch.topk/argmax over the same tensors, so tie-breaking is the
same too. The RNG-driven paths draw the same numbers in the same order: RTS draws one uniform
per (token, expert) of the [S, E] mask, top-2 sampling one Gumbel per logit, 'RSample' one Gumbel per
logit, 'Jitter' one uniform per input element, all through torch.distributions' `rsample`, which
is `torch.rand(shape)` transformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import comm as ds_comm

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    """The sparse routing of S tokens over k routes each: `indices[r, s]` the expert of token s's r-th
    route (-1 when the capacity limit dropped it), `locations[r, s]` its slot in that expert's buffer,
    `gates[r, s]` its combine weight (differentiable), `capacity` the buffer rows per expert."""

    indices: Tensor     # [k, S] int64
    locations: Tensor   # [k, S] int64
    gates: Tensor       # [k, S] float32
    capacity: int
    num_experts: int

    def dense(self) -> tuple[Tensor, Tensor]:
        """Upstream's (combine_weights[S, E, C], dispatch_mask[S, E, C])."""
        num_tokens = self.indices.shape[1]
        width = self.num_experts * self.capacity
        slots = self.slots()
        combine = self.gates.new_zeros(num_tokens, width + 1)
        for r in range(self.indices.shape[0]):   # routes of one token never share a slot: exact sums
            combine = combine.scatter_add(1, slots[r].unsqueeze(1), self.gates[r].unsqueeze(1))
        combine = combine[:, :width].reshape(num_tokens, self.num_experts, self.capacity)
        return combine, combine.bool()

    def slots(self, capacity: int | None = None) -> Tensor:
        """[k, S] flat slot `expert * capacity + location` of each route in an [E * capacity] buffer
        (`capacity` may exceed the gate's: a buffer padded to the group's largest); dropped routes
        point at the extra row E * capacity."""
        capacity = self.capacity if capacity is None else capacity
        flat = self.indices * capacity + self.locations
        return torch.where(self.indices >= 0, flat, torch.full_like(flat, self.num_experts * capacity))


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Rows per expert when tokens may be dropped: ceil(S / E * factor), at least `min_capacity`.
    float32 arithmetic, as upstream's tensor formula, so the rounding is the same."""
    factor = torch.tensor(capacity_factor)   # host: scalar arithmetic, read back as an int
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32) * factor   # host: as above
    return max(int(torch.ceil(per_expert)), int(min_capacity))


def _uniform(shape: Any, low: float, high: float, device: torch.device) -> Tensor:
    return torch.distributions.Uniform(torch.tensor(low, device=device), torch.tensor(high, device=device)).rsample(shape)


def _gumbel(shape: Any, device: torch.device) -> Tensor:
    return torch.distributions.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)).rsample(shape)


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """x times a uniform draw in [1 - epsilon, 1 + epsilon] per element (Switch Transformer)."""
    return x if epsilon == 0 else x * _uniform(x.shape, 1.0 - epsilon, 1.0 + epsilon, device)


def gumbel_rsample(shape: Any, device: torch.device) -> Tensor:
    return _gumbel(shape, device)


def _group_max(value: Tensor, ep_group: Any) -> Tensor:
    """The largest `value` over the expert-parallel group: every member must agree on a no-drop
    capacity. Every member calls this on every forward, whatever its tokens route to."""
    if ep_group is not None and ds_comm.is_initialized() and ds_comm.get_world_size(group=ep_group) > 1:
        value = value.clone()
        ds_comm.all_reduce(value, op=ds_comm.ReduceOp.MAX, group=ep_group)
    return value


def _balance(gates: Tensor, mask: Tensor) -> Tensor:
    """GShard's load-balancing term per expert: mean gate probability times the fraction of tokens
    routed to it (callers scale it in upstream's order of operations, so l_aux rounds the same)."""
    return torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)


def _out(l_aux: Tensor, routes: Routes, exp_counts: Tensor, sparse_routes: bool, want_routes: bool) -> tuple:
    """Routes form, upstream's sparse 7-tuple, or upstream's dense 4-tuple."""
    if want_routes:
        return l_aux, routes, exp_counts
    if sparse_routes:
        return (l_aux, torch.tensor(routes.capacity),  # host: upstream's capacity, a host scalar
                routes.num_experts, routes.indices.to(torch.int32), routes.locations.to(torch.int32), routes.gates,
                exp_counts)
    combine, dispatch = routes.dense()
    return l_aux, combine, dispatch, exp_counts


def _route_of(mask: Tensor, indices: Tensor, locations: Tensor, gates_s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One route's (expert or -1, location, gate) from its [S, E] kept-mask."""
    kept = mask.gather(1, indices.unsqueeze(1)).squeeze(1).bool()
    return (torch.where(kept, indices, torch.full_like(indices, -1)), torch.where(kept, locations, 0),
            torch.where(kept, gates_s, torch.zeros_like(gates_s)))


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False, *,
               routes: bool = False) -> tuple:
    """Switch-style top-1 gating. With `drop_tokens`, each expert keeps at most
    ceil(S / E * capacity_factor) (>= min_capacity) tokens, chosen at random (RTS) or by position;
    without, the capacity is the largest expert load over the expert-parallel group (and <= S)."""
    noisy = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chosen = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(chosen, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = torch.sum(mask, dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(int(_group_max(torch.max(exp_counts), ep_group)), num_tokens)
    l_aux = torch.sum(_balance(gates, mask)) * num_experts
    candidates = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise ValueError(f"top-1 gating: {num_tokens} tokens on this rank is fewer than min_capacity={min_capacity}; "
                         f"set min_capacity to at most the tokens per batch (or 0), or use a larger batch")
    # each expert keeps the `capacity` highest-scoring of its tokens (all of them when it has fewer)
    keep = torch.topk(candidates, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    gates_s = torch.sum(gates * mask.float(), dim=1)   # one non-zero term: exact
    route = _route_of(mask, chosen, locations, gates_s)
    return _out(l_aux, Routes(*(t.unsqueeze(0) for t in route), capacity, num_experts), exp_counts, sparse_routes,
                routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False, *,
               routes: bool = False) -> tuple:
    """GShard top-2 gating: the best expert, then the best other one (sampled with Gumbel noise on
    the logits when `top2_2nd_expert_sampling`); the two gates renormalised over the kept routes.
    Capacity 2 * S / E * capacity_factor; second routes queue behind every first route."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(_balance(gates, mask1)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(loc1, capacity)
        mask2 = mask2 * torch.lt(loc2, capacity)
    else:
        capacity = int(_group_max(torch.max(exp_counts), ep_group))
    gates1 = torch.sum(gates * mask1.float(), dim=1)
    gates2 = torch.sum(gates * mask2.float(), dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates1.dtype).eps)
    r1 = _route_of(mask1, first, torch.sum(loc1 * mask1, dim=1), gates1 / denom)
    r2 = _route_of(mask2, second, torch.sum(loc2 * mask2, dim=1), gates2 / denom)
    stacked = Routes(*(torch.stack([a, b]) for a, b in zip(r1, r2)), capacity, num_experts)
    return _out(l_aux, stacked, exp_counts, sparse_routes, routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False, *,
               routes: bool = False) -> tuple:
    """Top-k gating, gates renormalised over the kept routes. Dropping keeps, per expert, the tokens
    with the highest gate ('probs') or the first ones ('position'); capacity k * S / E * factor."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating: drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(_balance(gates, mask)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            scores = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            best = torch.topk(scores, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(mask).scatter_(0, best, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask & torch.lt(locations, capacity)
    else:
        capacity = int(_group_max(torch.max(exp_counts), ep_group))
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(torch.sum(masked, dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)
    stacked = Routes(torch.where(kept, top_idx, -1).t().contiguous(), (locations.gather(1, top_idx) * kept).t().contiguous(),
                     masked.gather(1, top_idx).t().contiguous(), capacity, num_experts)
    return _out(l_aux, stacked, exp_counts, sparse_routes, routes)


def _check_policy(noisy_gate_policy: Optional[str]) -> None:
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")


__all__ = ["Routes", "capacity_for", "multiplicative_jitter", "gumbel_rsample", "top1gating", "top2gating",
           "topkgating"]
