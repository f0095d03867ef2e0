"""Expert dispatch under AutoEP x AutoTP folding: the tensor peers share the routed assignments.

[Note: folded assignment dispatch]
Tensor-parallel peers hold the same tokens and route them alike. Rather than every peer sending
every (token, expert) assignment to the expert owners (tp copies of the same work), the peers split
the assignments: within each expert's run of the expert-sorted assignments, the i-th one goes to
tensor peer i % tp (`partition_assignments`; the ordinals come from `assignment_ordinals_by_expert`),
so each peer dispatches about 1/tp of every expert's rows over its expert-parallel group. After the
experts, `restore_combined` all-gathers the peers' expert outputs, combine weights and token/slot
indices and adds every row, weighted, into its token, one top-k slot at a time in slot order (the
order upstream's and our unfolded combine add them), so every peer holds the same full output.

Gradients. The all-gather's backward is its exact vector-Jacobian product: the peers' output
gradients are summed and each peer keeps the rows it computed, which is right when each peer's
output feeds its own term of the objective (the dispatch tests check that). In a model the
tensor peers' outputs feed one replicated loss, so the layers (module_inject/auto_ep_layer.py)
call `fold_dispatch`, which scales the restored output's gradient by 1/tp (the mean of identical
gradients is that gradient) and sums the gradients of the replicated inputs it partitioned
(the tokens and the router's scores, through `sum_gradient_over_tp`), because each peer's backward
reaches only its own assignments' rows. Every tensor peer then holds the exact gradient of the
inputs and of the router, and each expert row gets its gradient once in the tensor group, so the
expert-gradient rule of runtime/engine_moe.py ([Note: expert gradients]) holds unchanged; no
after-the-fact correction of the optimizer's gradients is needed (upstream rescales them instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import comm as dist   # upstream's name: its tests patch `ep_tp_dispatch.dist`

_MODULUS = 2_147_483_647   # a prime below 2**31: every product of two residues fits in int64


@dataclass
class RoutedAssignmentPayload:
    """One routing decision, one row per (token, expert) assignment, sorted by expert: the token it
    came from, its expert, its ordinal in that expert's run, its top-k slot (`capacity_slots`), its
    combine weight, and whether it was dropped or is padding. `extra` may hold "num_tokens" and
    "destination_ranks" (the EP rank owning each row's expert; the per-rank splits are recounted
    from it)."""

    token_indices: torch.Tensor
    expert_indices: torch.Tensor
    assignment_indices: torch.Tensor
    capacity_slots: torch.Tensor
    combine_weights: torch.Tensor
    drop_mask: torch.Tensor
    pad_mask: torch.Tensor
    input_splits: list
    output_splits: list
    extra: dict = field(default_factory=dict)


@dataclass
class RestoreContext:
    """What `restore_combined` needs: the whole payload and the rows this tensor peer kept."""

    original_payload: RoutedAssignmentPayload
    local_indices: torch.Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict


_ROW_FIELDS = ("token_indices", "expert_indices", "assignment_indices", "capacity_slots", "combine_weights",
               "drop_mask", "pad_mask")


def assignment_ordinals_by_expert(expert_indices: torch.Tensor) -> torch.Tensor:
    """Each row's position within its run of equal expert ids ([0, 0, 2, 2, 2] -> [0, 1, 0, 1, 2])."""
    ids = expert_indices.reshape(-1).to(torch.long)
    if ids.numel() == 0:
        return ids
    _, run_lengths = torch.unique_consecutive(ids, return_counts=True)
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    positions = torch.arange(ids.numel(), device=ids.device, dtype=torch.long)
    return positions - torch.repeat_interleave(run_starts, run_lengths)


def _select(payload: RoutedAssignmentPayload, rows: torch.Tensor) -> RoutedAssignmentPayload:
    """The payload's rows `rows` (per-row extras cut alike; the splits recounted by the caller)."""
    n = payload.token_indices.shape[0]
    extra = {k: (v.index_select(0, rows) if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v)
             for k, v in payload.extra.items()}
    cut = {name: getattr(payload, name).index_select(0, rows) for name in _ROW_FIELDS}
    return RoutedAssignmentPayload(**cut, input_splits=list(payload.input_splits),
                                   output_splits=list(payload.output_splits), extra=extra)


def _splits_by_destination(payload: RoutedAssignmentPayload) -> list:
    destinations = payload.extra.get("destination_ranks")
    if destinations is None or not payload.input_splits:
        return list(payload.input_splits)
    width = len(payload.input_splits)
    return torch.bincount(destinations.to(torch.long), minlength=width)[:width].tolist()


def _num_tokens(payload: RoutedAssignmentPayload) -> int:
    value = payload.extra.get("num_tokens", 0)
    return int(value.item()) if torch.is_tensor(value) else int(value)


def partition_assignments(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_rank: int,
                          tp_size: int) -> tuple:
    """This tensor peer's share of the live (not dropped, not padding) assignments: ordinal % tp_size
    == tp_rank ([Note: folded assignment dispatch]). Returns (the local payload, its RestoreContext).
    No collective: every peer computes the same split from the same payload."""
    live = ~(payload.drop_mask | payload.pad_mask)
    keep = live if tp_size <= 1 else live & (payload.assignment_indices.remainder(tp_size) == tp_rank)
    local_indices = keep.nonzero().reshape(-1)
    local = _select(payload, local_indices)
    local.input_splits = _splits_by_destination(local)
    local.output_splits = list(local.input_splits)
    counters = {"assignments_total": int(live.sum()), "assignments_local": int(local_indices.numel()),
                "padded": int(payload.pad_mask.sum()), "dropped": int(payload.drop_mask.sum()),
                "split_sum_in": sum(local.input_splits), "split_sum_out": sum(local.output_splits)}
    return local, RestoreContext(payload, local_indices, tp_rank, tp_size, _num_tokens(payload), counters)


def dispatch_counters(ctx: RestoreContext) -> dict:
    """A copy of the partition's counters (live assignments in all and here, padded, dropped)."""
    return dict(ctx.counters)


def _checksums(values: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums mod a prime of a tensor's exact values (floats by their fp32 bits)."""
    values = values.detach().reshape(-1)
    if values.is_floating_point():
        values = values.float().view(torch.int32)
    words = values.to(torch.long).remainder(_MODULUS)
    pos = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.long)
    first = (words * pos.remainder(_MODULUS)).remainder(_MODULUS).sum()
    second = (words * (pos * pos).remainder(_MODULUS)).remainder(_MODULUS).sum()
    return torch.stack((first, second))


def _payload_fingerprint(payload: RoutedAssignmentPayload) -> torch.Tensor:
    device = payload.token_indices.device
    parts = [torch.tensor([payload.token_indices.numel(), sum(payload.input_splits), sum(payload.output_splits)],
                          device=device, dtype=torch.long)]
    parts += [_checksums(getattr(payload, name)) for name in _ROW_FIELDS]
    destinations = payload.extra.get("destination_ranks")
    if torch.is_tensor(destinations):
        parts.append(_checksums(destinations))
    return torch.cat(parts)


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_size: int) -> None:
    """Raise on every tensor peer when their routing payloads differ (a fingerprint compared by a MAX
    and a MIN all-reduce over the tensor group): the assignment split assumes identical payloads.
    Collective over the tensor group; the layers call it with `validate_folding_routing`."""
    if tp_size <= 1 or not dist.is_initialized():
        return
    fingerprint = _payload_fingerprint(payload)
    high, low = fingerprint.clone(), fingerprint.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
    if not torch.equal(high, low):
        raise RuntimeError("AutoEP+AutoTP routing decisions differ across tensor-parallel lanes: the folded dispatch "
                           "splits one routing decision over the tensor peers, so their routed-token payloads must "
                           f"be identical (fingerprint on this rank {fingerprint.tolist()}, min {low.tolist()}, "
                           f"max {high.tolist()}); check that the MoE input and the router are replicated")


class _GatherRows(torch.autograd.Function):
    """All-gather of the peers' variable-length row blocks, joined in rank order. Backward: the
    output gradients summed over the peers, this peer's block kept (the exact VJP)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: Any, counts: tuple, rank: int) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.rank = group, counts, rank
        return _gather_padded(rows, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        longest = max(ctx.counts)
        blocks = grad.new_zeros((len(ctx.counts), longest) + tuple(grad.shape[1:]))
        for block, part, count in zip(blocks, grad.split(list(ctx.counts)), ctx.counts):
            block[:count] = part
        dist.all_reduce(blocks, group=ctx.group)
        return blocks[ctx.rank, :ctx.counts[ctx.rank]].contiguous(), None, None, None


def _gather_padded(rows: torch.Tensor, group: Any, counts: tuple) -> torch.Tensor:
    longest = max(counts)
    if longest == 0:
        return rows.new_empty((0,) + tuple(rows.shape[1:]))
    padded = rows.new_zeros((longest,) + tuple(rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def _row_counts(rows: int, group: Any, tp_size: int, device: torch.device) -> tuple:
    mine = torch.tensor([rows], device=device, dtype=torch.long)
    every = [torch.empty_like(mine) for _ in range(tp_size)]
    dist.all_gather(every, mine, group=group)
    return tuple(int(c) for c in torch.cat(every).tolist())


def _check_coverage(ctx: RestoreContext, gathered_keys: torch.Tensor) -> None:
    """The gathered (token, expert, ordinal, slot) rows must be exactly the payload's live rows."""
    payload = ctx.original_payload
    live = ~(payload.drop_mask | payload.pad_mask)
    expected = torch.stack([getattr(payload, n)[live].to(torch.long) for n in _ROW_FIELDS[:4]], dim=1)
    if gathered_keys.shape[0] != expected.shape[0]:
        raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: the tensor peers restored "
                           f"{gathered_keys.shape[0]} assignments, the routing decision has {expected.shape[0]}")
    if expected.numel() == 0:
        return
    want, want_counts = torch.unique(expected, dim=0, return_counts=True)
    got, got_counts = torch.unique(gathered_keys, dim=0, return_counts=True)
    if not (torch.equal(want, got) and torch.equal(want_counts, got_counts)):
        raise RuntimeError("AutoEP+AutoTP restore coverage mismatch: the restored assignments are not the routing "
                           "decision's (one is missing, repeated or unknown)")


def restore_combined(local_combined: torch.Tensor, ctx: RestoreContext, *, tp_group: Any,
                     validate_coverage: bool = False) -> torch.Tensor:
    """Every token's output [num_tokens, H] from the peers' expert outputs for their assignments
    (`local_combined`, one row per ctx.local_indices): gathered over the tensor group, weighted by
    the combine weights in fp32 and added into their tokens one top-k slot at a time
    ([Note: folded assignment dispatch]); returned in local_combined's dtype. Collective over the
    tensor group when ctx.tp_size > 1. `validate_coverage` checks the peers restored each live
    assignment exactly once (one more gather)."""
    payload, rows = ctx.original_payload, ctx.local_indices
    keys = torch.stack([getattr(payload, n).index_select(0, rows).to(torch.long) for n in _ROW_FIELDS[:4]], dim=1)
    weights = payload.combine_weights.index_select(0, rows)
    values = local_combined
    if ctx.tp_size > 1 and dist.is_initialized():
        counts = _row_counts(values.shape[0], tp_group, ctx.tp_size, values.device)
        rank = dist.get_rank(group=tp_group)
        keys = _gather_padded(keys, tp_group, counts)
        values = _GatherRows.apply(values, tp_group, counts, rank) if values.requires_grad else \
            _gather_padded(values, tp_group, counts)
        weights = _GatherRows.apply(weights, tp_group, counts, rank) if weights.requires_grad else \
            _gather_padded(weights, tp_group, counts)
    if validate_coverage:
        _check_coverage(ctx, keys)
    num_tokens = ctx.num_tokens if ctx.num_tokens > 0 else int(payload.token_indices.max()) + 1 \
        if payload.token_indices.numel() else 0
    weighted = values.float() * weights.float().reshape((-1,) + (1,) * (values.dim() - 1))
    out = weighted.new_zeros((num_tokens,) + tuple(values.shape[1:]))
    tokens, slots = keys[:, 0], keys[:, 3]
    for slot in torch.unique(slots).tolist():   # slot by slot: each token's k rows added in slot order
        chosen = slots == slot
        out = out.index_add(0, tokens[chosen], weighted[chosen])
    return out.to(local_combined.dtype)


class _GradientOnly(torch.autograd.Function):
    """Identity; backward multiplies the gradient by `scale`, then sums it over `group` unless
    `group` is False."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous() * ctx.scale
        if ctx.group is not False:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def sum_gradient_over_tp(x: torch.Tensor, tp_group: Any, tp_size: int) -> torch.Tensor:
    """`x` (replicated over the tensor peers), its gradient summed over them: for a tensor whose
    rows the peers' assignment shares read separately ([Note: folded assignment dispatch])."""
    if tp_size <= 1 or not x.requires_grad:
        return x
    return _GradientOnly.apply(x, tp_group, 1.0)


def fold_dispatch(payload: RoutedAssignmentPayload, fold: tuple,
                  compute: Callable[[RoutedAssignmentPayload, torch.Tensor], torch.Tensor],
                  validate_routing: bool = False) -> torch.Tensor:
    """The folded expert dispatch of one layer ([Note: folded assignment dispatch]): `fold` =
    (tensor group, tp size, tp rank); `compute(local payload, local row indices)` returns the expert
    outputs of this peer's assignments (the EP exchange happens inside it). Returns the combined
    [num_tokens, H] output, identical on the tensor peers, whose gradient is the replicated
    loss's (the tokens and the weights must come through `sum_gradient_over_tp`)."""
    group, tp_size, tp_rank = fold
    if validate_routing:
        assert_tp_payload_consistent(payload, tp_group=group, tp_size=tp_size)
    local, ctx = partition_assignments(payload, tp_group=group, tp_rank=tp_rank, tp_size=tp_size)
    restored = restore_combined(compute(local, ctx.local_indices), ctx, tp_group=group)
    return _GradientOnly.apply(restored, False, 1.0 / tp_size) if restored.requires_grad else restored


def payload_from_routing(token: torch.Tensor, slot: torch.Tensor, expert: torch.Tensor, weights: torch.Tensor,
                         num_tokens: int, ep_size: int, num_local_experts: int,
                         extra: Optional[dict] = None) -> RoutedAssignmentPayload:
    """The payload of expert-sorted assignments (token, top-k slot, expert id, combine weight);
    nothing dropped or padded (AutoEP routes every assignment: [Note: AutoEP dispatch])."""
    none = torch.zeros_like(expert, dtype=torch.bool)
    return RoutedAssignmentPayload(
        token_indices=token.to(torch.long), expert_indices=expert.to(torch.long),
        assignment_indices=assignment_ordinals_by_expert(expert), capacity_slots=slot.to(torch.long),
        combine_weights=weights, drop_mask=none, pad_mask=none.clone(), input_splits=[0] * ep_size,
        output_splits=[0] * ep_size,
        extra={"destination_ranks": expert.to(torch.long) // num_local_experts,
               "num_tokens": num_tokens, **(extra or {})})
