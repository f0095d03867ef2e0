# compat: upstream path deepspeed.moe.layer (DeepSpeed 0.19.8 names).
"""`MoE`: upstream's mixture-of-experts layer (gate + expert-parallel experts, optional residual MLP).

[Note: when the expert groups are made]
The expert-parallel and expert-data-parallel groups (`ep_size_<n>`, deepspeed.utils.groups over the
parallel-dims mesh) are made by `set_deepspeed_parallelism()`, which the engine calls on every MoE
module once it has set up the mesh, as upstream's engine does. A layer used before that (no engine)
with ep_size > 1 makes them on its first forward when torch.distributed is initialized (a collective:
every rank runs that forward); with ep_size == 1 it needs no group at all.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from .. import comm as ds_comm
from ..runtime.errors import NotSupportedYet
from ..utils import groups
from .experts import Experts
from .gating import _check_policy
from .sharded_moe import MOELayer, TopKGate


class MoE(nn.Module):
    """A mixture-of-experts layer: `forward(hidden_states, used_token=None)` returns
    `(output, l_aux, exp_counts)`. `num_experts` experts (deep copies of `expert`), `ep_size` ranks
    share them (num_experts / ep_size each); `k`-way gating with expert capacity
    `capacity_factor` (`eval_capacity_factor` in eval mode), at least `min_capacity`; `drop_tokens=False`
    sizes the capacity to the largest expert load instead; `use_rts` picks dropped tokens at random;
    `noisy_gate_policy` 'Jitter' or 'RSample'; `use_residual` adds a dense MLP (`expert` itself)
    mixed in by a learned 2-way coefficient (Residual MoE, arXiv:2201.05596)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if int(ep_size) < 1 or int(num_experts) < 1 or int(num_experts) % int(ep_size) != 0:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})")
        _check_policy(noisy_gate_policy)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = int(ep_size)
        self.expert_group_name = f"ep_size_{self.ep_size}"
        self.num_experts = int(num_experts)
        self.num_local_experts = self.num_experts // self.ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, self.num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make (once per name; collective) this layer's expert groups and hand the EP group to the layer."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Under a client `mpu` with tensor parallelism the expert groups lie inside the tensor lanes
        (upstream's E + M + D); experts that are not tensor-parallel themselves
        (`enable_expert_tensor_parallelism=False`) see each tensor peer's share of the capacity slots
        ([Note: EP x TP folding] in moe/tp_tokens.py); tensor-parallel experts see every token."""
        mpu = groups.mpu if groups.mpu is not None and not groups._sp_only(groups.mpu) else None
        tensor_parallel = groups._get_model_parallel_world_size() if mpu is not None else 1
        if mpu is None and groups.get_tensor_model_parallel_world_size() > 1:
            raise NotSupportedYet(f"deepspeed.moe.layer.MoE (ep_size={self.ep_size}) with AutoTP (tensor_parallel."
                                  f"autotp_size={groups.get_tensor_model_parallel_world_size()}): AutoTP would slice "
                                  "the experts' Linear layers; use AutoEP (expert_parallel) for MoE models under "
                                  "AutoTP, or pass your Megatron-style mpu")
        # every call (idempotent for one layout): another engine may have left another layout (runtime/mesh.py)
        if tensor_parallel > 1 and self.enable_expert_tensor_parallelism:
            groups._create_expert_data_and_model_parallel(
                self.ep_size, mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        else:
            groups._create_expert_and_data_parallel(
                self.ep_size, mp_size=tensor_parallel,
                use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))
        if tensor_parallel > 1 and not self.enable_expert_tensor_parallelism:
            self.deepspeed_moe.tensor_fold = (groups._get_model_parallel_group(), tensor_parallel,
                                              groups._get_model_parallel_rank())

    @property
    def tensor_fold(self) -> Optional[tuple]:
        """(tensor group, size, rank) when this layer's experts see a share of the tokens."""
        return self.deepspeed_moe.tensor_fold

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.ep_size > 1 and self.deepspeed_moe.ep_group is None:
            if not ds_comm.is_initialized():
                raise RuntimeError(f"MoE(ep_size={self.ep_size}) needs torch.distributed: call "
                                   f"deepspeed.init_distributed() (or deepspeed.initialize) before the forward")
            self.set_deepspeed_parallelism()   # [Note: when the expert groups are made]
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


__all__ = ["MoE"]
