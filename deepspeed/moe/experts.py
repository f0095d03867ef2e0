# compat: upstream path deepspeed.moe.experts (DeepSpeed 0.19.8 names).
"""`Experts`: this rank's local experts, deep copies of one expert module.

[Note: expert parameter marks]
Every expert parameter carries `allreduce = False` and `group_name = <expert group name>`
(`ep_size_<n>`): the engine averages these gradients over the expert-data-parallel group of that
name instead of the data-parallel group, and `deepspeed.moe.utils` puts them in optimizer groups
of their own. The marks are set here, once, by the owner of the expert copies.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


class Experts(nn.Module):
    """`num_local_experts` copies of `expert` (`deepspeed_experts`, upstream's name, which the
    checkpoint layout keys on). The input [..., num_local_experts, C, M] is split along dim 1,
    one chunk per expert; an expert returning a tuple contributes its first element."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        if int(num_local_experts) < 1:
            raise ValueError(f"Experts: num_local_experts must be >= 1, got {num_local_experts}")
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(int(num_local_experts))])
        self.num_local_experts = int(num_local_experts)
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


__all__ = ["Experts"]
