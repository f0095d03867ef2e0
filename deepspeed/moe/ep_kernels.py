"""Row permutations of expert-parallel dispatch: group rows by expert id (a stable sort, so rows of
one expert keep their order) and put results back where they came from."""

from __future__ import annotations

import torch


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): `rows[order]` groups rows by expert id (stable); counts[e] rows of expert e."""
    order = torch.argsort(expert_ids, stable=True)
    return order, torch.bincount(expert_ids, minlength=num_experts)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inv` with `grouped[inv]` restoring the rows' original order when `grouped = rows[order]`."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def local_ids_by_source(local_counts_by_source: torch.Tensor) -> torch.Tensor:
    """Local expert id of each received row when every source sent its rows sorted by expert:
    row s of the [ep, E_local] count matrix gives source s's run of ids."""
    ep, local = local_counts_by_source.shape
    ids = torch.arange(local, device=local_counts_by_source.device).repeat(ep)
    return ids.repeat_interleave(local_counts_by_source.reshape(-1).to(torch.int64))
