"""Per-expert token counts of a routing decision (AutoEP's router and split plan share it)."""

from __future__ import annotations

import torch


def count_tokens_per_expert(selected_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 histogram [num_experts] of the expert ids in `selected_experts` (any shape)."""
    flat = selected_experts.reshape(-1).to(torch.int64)
    return torch.bincount(flat, minlength=num_experts)[:num_experts].to(torch.int32)
