"""AutoEP's experts of one rank as three stacked weights (w1 gate [E, F, H], w3 up [E, F, H], w2
down [E, H, F]), run on rows already grouped by expert.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "geglu_tanh": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "geglu": lambda gate, up: F.gelu(gate) * up,
}


class GroupedExperts(nn.Module):
    """`num_experts` gated MLPs; forward(x, num_tokens_per_expert) takes the rows of x grouped by
    expert (counts in expert order) and returns each row's expert output in the same order.
    (`use_grouped_mm` selects torch._grouped_mm on accelerators upstream; experts run as one
    matmul each here, which is what it computes.)"""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 activation: str = "swiglu", dtype: torch.dtype = None, device: torch.device = None, **_) -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert_activation must be one of {tuple(EXPERT_ACTIVATIONS)}, got {activation!r}")
        kw = dict(dtype=dtype, device=device)
        self.num_experts, self.use_grouped_mm, self.activation = num_experts, use_grouped_mm, activation
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        if sum(counts) != x.shape[0]:
            raise ValueError(f"GroupedExperts: {x.shape[0]} rows but num_tokens_per_expert sums to {sum(counts)}")
        act = EXPERT_ACTIVATIONS[self.activation]
        outs = [F.linear(act(F.linear(rows, self.w1[e]), F.linear(rows, self.w3[e])), self.w2[e])
                for e, rows in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x.new_empty((0, self.w2.shape[1]))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ffn={self.w1.shape[1]}, hidden={self.w1.shape[2]}, {self.activation}"


