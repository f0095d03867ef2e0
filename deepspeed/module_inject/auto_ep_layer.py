"""AutoEP's expert-parallel experts: a drop-in for a Hugging Face fused experts module
(`forward(hidden_states, top_k_index, top_k_weights)`, Transformers 5.x) holding num_experts/ep of
its experts and exchanging tokens with the other EP ranks by all-to-all ([Note: AutoEP dispatch]).

[Note: AutoEP dispatch]
Each (token, slot) assignment goes to the EP rank owning its expert: assignments are sorted by
expert id (stable), the per-destination counts are exchanged first (one all-to-all of ep integers:
sizes are exchanged, never assumed), then the rows and their local expert ids travel by a
variable-split all-to-all. Every EP rank computes its experts on what it received (an expert with
no rows still runs on an empty batch, so every local expert parameter gets a gradient, zero when
unused) and the results travel back by the reverse all-to-all; the sender weights them by the
router's top-k weights and adds them into each token's row, as the HF experts module does. No
capacity, no dropping: HF semantics. A rank with no token for any remote (or any) expert still
takes part in every collective with empty splits, so nothing hangs. The all-to-all's backward is
the reverse exchange of the gradients, so a local expert's gradient sums the contributions of the
tokens of every rank of its EP group ([Note: expert gradients] in runtime/engine_moe.py).

State dicts hold the original HF layout: `state_dict()` all-gathers each fused parameter over the EP
group (collective: every EP rank must call it; Accelerate's get_state_dict and save_16bit_model do),
except with keep_vars or inside `local_expert_state()` (the engine's per-rank checkpoint files).
`load_state_dict` takes the whole tensor (and keeps this rank's experts) or this rank's slice.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm as ds_comm

_LOCAL = threading.local()


@contextlib.contextmanager
def local_expert_state() -> Iterator[None]:
    """Inside: state_dict() of AutoEP experts holds this rank's slices (no collective)."""
    before = getattr(_LOCAL, "on", False)
    _LOCAL.on = True
    try:
        yield
    finally:
        _LOCAL.on = before


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all over dim 0; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        ds_comm.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _AllToAll.apply(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange_counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    recv = torch.empty_like(send)
    ds_comm.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


class ExpertParallelExperts(nn.Module):
    """This EP rank's experts of one HF MoE block, under the HF parameter names (w1: gate_up_proj
    [E/ep, 2I, H], w2: down_proj [E/ep, H, I]). The parameters are the HF module's own Parameter
    objects cut to this rank's slice (an optimizer built before the swap still holds them), marked
    `allreduce=False`, `group_name="ep_size_<ep>"` (the engine's expert-gradient contract)."""

    def __init__(self, original: nn.Module, w1: str, w2: str, num_experts: int, ep_size: int, ep_rank: int,
                 group: Any) -> None:
        super().__init__()
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.ep_group = group
        self.act_fn = original.act_fn
        self._w1, self._w2 = w1, w2
        first = ep_rank * self.num_local_experts
        for name in (w1, w2):
            param = getattr(original, name)
            with torch.no_grad():
                param.data = param.data[first:first + self.num_local_experts].clone()
            param.allreduce = False
            param.group_name = self.expert_group_name
            self.register_parameter(name, param)
        self.first_expert = first

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine's MoE set-up calls this; the groups were built when the block was swapped."""

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts}, ep_size={self.ep_size}")

    def _compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows (rows in any order; the result in the same order)."""
        w1, w2 = getattr(self, self._w1), getattr(self, self._w2)
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.num_local_experts).tolist()
        outs = []
        for e, chunk in enumerate(rows[order].split(counts)):
            gate, up = F.linear(chunk, w1[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, w2[e]))
        ordered = torch.cat(outs) if outs else rows
        return ordered[torch.argsort(order)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < self.num_experts]   # HF's experts skip ids >= num_experts
        expert = flat[order]
        token, slot = order // k, order % k
        rows = hidden_states[token]
        if self.ep_size > 1:
            dest = torch.div(expert, self.num_local_experts, rounding_mode="floor")
            send = torch.bincount(dest, minlength=self.ep_size)
            recv = _exchange_counts(send, self.ep_group)
            send_l, recv_l = send.tolist(), recv.tolist()
            local = expert - dest * self.num_local_experts
            got_ids = local.new_empty(sum(recv_l))
            ds_comm.all_to_all_single(got_ids, local.contiguous(), output_split_sizes=recv_l,
                                      input_split_sizes=send_l, group=self.ep_group)
            got = _AllToAll.apply(rows, send_l, recv_l, self.ep_group)
            out = _AllToAll.apply(self._compute(got, got_ids), recv_l, send_l, self.ep_group)
        else:
            out = self._compute(rows, expert)
        out = out * top_k_weights[token, slot, None]
        return torch.zeros_like(hidden_states).index_add(0, token, out.to(hidden_states.dtype))

    # -- the HF layout in state dicts ----------------------------------------------------------
    def full_param(self, name: str) -> torch.Tensor:
        """The whole fused tensor (every EP rank's experts, in order). Collective over the EP group."""
        local = getattr(self, name).detach().contiguous()
        if self.ep_size == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(self.ep_size)]
        ds_comm.all_gather(parts, local, group=self.ep_group)
        return torch.cat(parts)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if keep_vars or getattr(_LOCAL, "on", False):
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in (self._w1, self._w2):
            destination[prefix + name] = self.full_param(name)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in (self._w1, self._w2):
            value = state_dict.get(prefix + name)
            if value is not None and value.dim() == 3 and value.shape[0] == self.num_experts != self.num_local_experts:
                state_dict[prefix + name] = value[self.first_expert:self.first_expert + self.num_local_experts]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def autoep_layers(module: nn.Module) -> list[ExpertParallelExperts]:
    return [m for m in module.modules() if isinstance(m, ExpertParallelExperts)]
