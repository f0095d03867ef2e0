"""AutoEP's token-choice top-k router: the routing of a Hugging Face MoE block re-expressed by its
preset (score function, top-k normalisation, scale, group-limited routing), for blocks that AutoEP
replaces whole (module_inject/auto_ep_layer.AutoEPMoELayer).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .ep_count import count_tokens_per_expert


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its top_k experts by score (softmax or sigmoid of `gate(x)` in fp32).

    With num_expert_groups, experts form that many equal groups and only the num_limited_groups best
    groups (by their top-2 sum, or max with group_score_func="max") are eligible (DeepSeek's
    group-limited routing). `e_score_correction_bias` (DeepSeek-V3) shifts the choice, not the weights.
    Returns (top_scores [T, k] fp32, selected experts [T, k], tokens per expert [E] int32)."""

    def __init__(self, dim: int, num_experts: int, num_expert_groups: Optional[int], num_limited_groups: Optional[int],
                 top_k: int, score_func: str, route_norm: bool, route_scale: float, gate_bias: bool,
                 group_score_func: str = "top2_sum") -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if group_score_func not in ("top2_sum", "max"):
            raise ValueError(f"group_score_func must be 'top2_sum' or 'max', got {group_score_func!r}")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.group_score_func = group_score_func
        self.e_score_correction_bias: Optional[torch.Tensor] = None

    def _limit_to_groups(self, scores: torch.Tensor) -> torch.Tensor:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if limited is None or not 1 <= limited <= groups or self.num_experts % groups:
            raise ValueError(f"group-limited routing needs 1 <= num_limited_groups <= num_expert_groups dividing "
                             f"num_experts={self.num_experts}; got num_expert_groups={groups}, "
                             f"num_limited_groups={limited}")
        grouped = scores.view(scores.shape[0], groups, -1)
        if self.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            if grouped.shape[-1] < 2:
                raise ValueError(f"group_score_func 'top2_sum' needs >= 2 experts per group, got {grouped.shape[-1]}")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(limited, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)

    def forward(self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None) -> tuple:
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores
        for bias in (expert_bias, self.e_score_correction_bias):
            if bias is not None:
                choice = choice + bias.float()
        if self.num_expert_groups is not None:
            choice = self._limit_to_groups(choice)
        selected = choice.topk(self.top_k, dim=-1).indices
        top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores * self.route_scale, selected, count_tokens_per_expert(selected, self.num_experts)
