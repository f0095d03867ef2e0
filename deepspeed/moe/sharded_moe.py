# compat: upstream path deepspeed.moe.sharded_moe (DeepSpeed 0.19.8 names).
"""`TopKGate` and `MOELayer`: GShard's mixture-of-experts layer with experts sharded over an
expert-parallel (EP) group and tokens exchanged by all-to-all.

[Note: the MoE exchange]
Every rank of an EP group of size P holds E / P experts (`num_local_experts`). A forward:
1. gates its own S tokens (gating.py): each route gets an expert and a slot below `capacity`;
2. agrees with the group (one all_reduce of two integers): any rank's input error makes every rank
   raise before any exchange, and the buffer rows per expert become the group's largest capacity,
   so the all-to-all sizes are exchanged, not assumed (ranks may hold different token counts);
3. writes its tokens into an [E, C, M] buffer (zeros where no token routes: a rank whose tokens
   route to no expert of some rank, or to none at all, still sends and receives its full share);
4. all-to-all over the EP group: rank i receives, from every rank, the rows of its own experts,
   [P, E / P, C, M]; runs its experts; all-to-all back;
5. sums each token's expert rows weighted by its gates (fp32).
Both all-to-alls are differentiable (the backward is the same exchange of the gradients), so
expert gradients on a rank are the sum over the group's tokens routed to its experts. Each rank
sends (P - 1) / P of 2 * E * C * M elements per forward, the same in backward.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

from .. import comm as ds_comm
from .tp_tokens import join_over_tensor, split_over_tensor
from .gating import (Routes, _check_policy, _out, capacity_for, gumbel_rsample, multiplicative_jitter, top1gating,
                     top2gating, topkgating)

# Upstream's name for deepspeed.comm in this module: its tests count the gating's collectives by patching
# `sharded_moe.dist.all_reduce` (the same module object, so gating.py's calls see the patch).
dist = ds_comm

TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"
TUTEL_INSTALLED = False   # Tutel kernels are not used by this build (MoE(use_tutel=True) warns and runs without)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over `group` along dim 0; its backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # noqa: A002 (upstream's signature)
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        ds_comm.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


class TopKGate(Module):
    """The router: a bias-free Linear(model_dim, num_experts) in fp32 and upstream's top-1/2/k gating.
    `gate(x)` returns `(l_aux, combine_weights, dispatch_mask, exp_counts)`; `gate(x, used_token,
    True)` upstream's sparse form `(l_aux, capacity, num_experts, indices, locations, gates, exp_counts)`
    with [k, S] route tensors (index -1: dropped)."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= int(k) <= int(num_experts):
            raise ValueError(f"TopKGate: k must be between 1 and num_experts={num_experts}, got k={k}")
        _check_policy(noisy_gate_policy)   # 'RSample' acts on top-1 only; upstream ignores it for k > 1
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = int(k)
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None and self.ep_group is not ep_group:
            raise RuntimeError("TopKGate: an expert-parallel group is already set for this gate; a layer's group "
                               "cannot change once routing has used it")
        self.ep_group = ep_group

    def capacity(self, num_tokens: int) -> int:
        """Rows per expert for `num_tokens` tokens when tokens may be dropped."""
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return capacity_for(num_tokens, self.wg.out_features, factor * self.k, self.min_capacity)

    def route(self, input: Tensor, used_token: Optional[Tensor] = None) -> tuple[Tensor, Routes, Tensor]:  # noqa: A002
        """(l_aux, Routes, exp_counts) for the [S, model_dim] `input`."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = torch.nn.functional.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group, routes=True)
        if used_token is not None:
            raise ValueError(f"TopKGate: used_token applies to top-1 gating only (k={self.k})")
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, routes=True)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group, routes=True)

    def forward(self, input: Tensor, used_token: Optional[Tensor] = None, sparse_routes: bool = False,  # noqa: A002
                use_tutel: bool = False) -> tuple:
        l_aux, routes, exp_counts = self.route(input, used_token)
        return _out(l_aux, routes, exp_counts, sparse_routes, False)


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Upstream's helper: each route's flat slot in an [E * capacity] buffer; dropped routes
    (index -1) the extra row E * capacity."""
    return Routes(indices.long(), locations.long(), indices.new_empty(0), int(capacity), int(num_experts)).slots()


def _sparse_encode(reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The [E, capacity, M] expert buffer with every routed token in its slot (zero rows elsewhere);
    differentiable (index_add: its gradient gathers the rows back)."""
    k = slots.shape[0]
    buffer = reshaped_input.new_zeros(num_experts * capacity + 1, reshaped_input.shape[1])
    buffer = buffer.index_add(0, slots.reshape(-1), reshaped_input.repeat(k, 1))   # dropped routes: the extra row
    return buffer[:-1].view(num_experts, capacity, reshaped_input.shape[1])


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Each token's gate-weighted sum of its routes' rows of the [E * capacity, M] expert output,
    accumulated in fp32 (the gates' dtype), returned in the output's dtype."""
    rows = torch.cat([expert_output, expert_output.new_zeros(1, expert_output.shape[1])])
    routed = rows.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, expert_output.shape[1])
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


def _route(gate: Module, tokens: Tensor, used_token: Optional[Tensor]) -> tuple[Tensor, Routes, Tensor]:
    """A `TopKGate`'s routes; any other gate through upstream's sparse 7-tuple."""
    if isinstance(gate, TopKGate):
        return gate.route(tokens, used_token)
    l_aux, capacity, num_experts, indices, locations, gates, exp_counts = gate(tokens, used_token, True)
    return l_aux, Routes(indices.long(), locations.long(), gates, int(capacity), int(num_experts)), exp_counts


def _agree(values: list[int], group: Any) -> list[int]:
    """Element-wise max of small integers over `group` (every member calls it on every forward)."""
    t = torch.tensor(values, dtype=torch.int64, device=ds_comm.collective_device(group))
    ds_comm.all_reduce(t, op=ds_comm.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


_INPUT_ERRORS = {1: "the input's last dim is not the gate's model_dim",
                 2: "a rank holds fewer tokens than min_capacity (top-1 gating needs at least min_capacity)"}


class MOELayer(Module):
    """Gate, dispatch by all-to-all, experts, combine ([Note: the MoE exchange]). After a forward,
    `l_aux` and `exp_counts` hold the gate's load-balancing loss and tokens per expert."""

    def __init__(self, gate: Module, experts: Module, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = int(ep_size)
        self.ep_group_name = ep_group_name
        self.num_local_experts = int(num_local_experts)
        self.use_tutel = False
        if use_tutel:
            warnings.warn("MOELayer(use_tutel=True): Tutel kernels are not used by this build; the layer runs its "
                          "own dispatch (same routing and results)", stacklevel=2)
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.tensor_fold: Optional[tuple] = None   # (tensor group, size, rank): [Note: EP x TP folding]

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _exchange(self) -> bool:
        return self.ep_size > 1

    def _check_input(self, tokens: Tensor) -> None:
        """Agree on input errors over the EP group before any collective: one bad rank, all raise."""
        code = 0
        if tokens.shape[-1] != self.gate.wg.in_features:
            code = 1
        elif getattr(self.gate, "k", 1) == 1 and tokens.shape[0] < self.gate.min_capacity:
            code = 2
        if self._exchange():
            code = _agree([code], self.ep_group)[0]
        if code:
            raise ValueError(f"MoE layer: {_INPUT_ERRORS[code]} (model_dim={self.gate.wg.in_features}, "
                             f"min_capacity={self.gate.min_capacity}; this rank's input {tuple(tokens.shape)})")

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002 (upstream's signature)
        if self._exchange() and self.ep_group is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size}: no expert-parallel group was set; call "
                               f"MoE.set_deepspeed_parallelism() (deepspeed.initialize does) first")
        x = input[0]
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        self._check_input(tokens)
        used_token = input[1] if len(input) > 1 else None
        self.l_aux, routes, self.exp_counts = _route(self.gate, tokens, used_token)
        capacity = routes.capacity
        if self._exchange():   # the group's largest: every rank's buffer has the same rows
            capacity = _agree([capacity], self.ep_group)[0]
        slots = routes.slots(capacity)
        num_experts = routes.num_experts
        dispatched = _sparse_encode(tokens, slots, num_experts, capacity)
        if self.tensor_fold is not None:   # this tensor peer's share of the capacity slots (upstream's drop_tokens)
            dispatched = split_over_tensor(dispatched, *self.tensor_fold, dim=1)
        share = dispatched.shape[1]
        if self._exchange():
            dispatched = _AllToAll.apply(self.ep_group, dispatched)
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, share, d_model))
        expert_output = expert_output.reshape(num_experts, share, d_model)
        if self._exchange():
            expert_output = _AllToAll.apply(self.ep_group, expert_output)
        if self.tensor_fold is not None:   # upstream's gather_tokens
            expert_output = join_over_tensor(expert_output, *self.tensor_fold, capacity, dim=1)
        combined = _sparse_decode(expert_output.reshape(num_experts * capacity, d_model), slots, routes.gates,
                                  tokens.shape[0])
        return combined.to(x.dtype).reshape(x.shape)


__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter",
           "gumbel_rsample", "TUTEL_INSTALLED"]
