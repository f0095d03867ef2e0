"""AutoEP's expert-parallel experts: a drop-in for a Hugging Face fused experts module
(`forward(hidden_states, top_k_index, top_k_weights)`, Transformers 5.x) holding num_experts/ep of
its experts and exchanging tokens with the other EP ranks by all-to-all ([Note: AutoEP dispatch]).

[Note: AutoEP dispatch]
Each (token, slot) assignment goes to the EP rank owning its expert: assignments are sorted by
expert id (stable), the per-(destination rank, local expert) counts are exchanged first (one
all-to-all of num_experts integers, SplitPlan: sizes are exchanged, never assumed; each rank then
knows the local expert of every row it receives, as every sender sorted them), then the rows travel by a
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
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm as ds_comm
from ..moe.ep_count import count_tokens_per_expert
from ..moe.ep_kernels import group_by_expert, inverse_permutation, local_ids_by_source
from ..moe.ep_tp_dispatch import fold_dispatch, payload_from_routing, sum_gradient_over_tp
from .auto_ep_alias import add_alias_entries, drop_alias_entries, router_alias_name
from .auto_ep_folding import mark_autoep_folding_router_parameter

# Upstream's name for deepspeed.comm in this module (its tests reach `auto_ep_layer.dist`): the same module object.
dist = ds_comm

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


class SplitPlan(NamedTuple):
    """One dispatch's sizes on this EP rank: rows sent to each EP rank (input_splits), rows received
    from each (output_splits), received rows per local expert (local_counts) and the same per
    source rank (local_counts_by_source [ep, E_local])."""

    input_splits: list
    output_splits: list
    local_counts: torch.Tensor
    local_counts_by_source: torch.Tensor


def _split_plan_from_counts(counts: torch.Tensor, rows: int, ep_size: int, num_local_experts: int,
                            ep_group: Any) -> SplitPlan:
    """One all-to-all of the [ep, E_local] per-(rank, local expert) counts gives every size."""
    if ep_size == 1:
        return SplitPlan([rows], [rows], counts, counts.view(1, num_local_experts))
    send = counts.to(torch.int32).contiguous()
    received = torch.empty_like(send)
    ds_comm.all_to_all_single(received, send, group=ep_group)
    by_source = received.view(ep_size, num_local_experts)
    return SplitPlan(send.view(ep_size, num_local_experts).sum(dim=1).tolist(), by_source.sum(dim=1).tolist(),
                     by_source.sum(dim=0), by_source)


def compute_split_plan(selected_experts: torch.Tensor, num_experts: int, ep_size: int, num_local_experts: int,
                       ep_group: Any, num_tokens_per_expert: Optional[torch.Tensor] = None) -> SplitPlan:
    """The split plan of a routing decision (`selected_experts` [T, k] global ids; the router's
    histogram may be passed to skip recounting). Collective over the EP group when ep_size > 1."""
    if num_tokens_per_expert is None:
        num_tokens_per_expert = count_tokens_per_expert(selected_experts, num_experts)
    return _split_plan_from_counts(num_tokens_per_expert, selected_experts.numel(), ep_size, num_local_experts,
                                   ep_group)


def compute_split_plan_from_expert_indices(expert_indices: torch.Tensor, num_experts: int, ep_size: int,
                                           num_local_experts: int, ep_group: Any) -> SplitPlan:
    """The split plan of a flat list of (already filtered) assignments."""
    return _split_plan_from_counts(count_tokens_per_expert(expert_indices, num_experts), expert_indices.numel(),
                                   ep_size, num_local_experts, ep_group)


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


def run_on_owners(rows: torch.Tensor, expert_ids: torch.Tensor, plan: SplitPlan, compute: Callable, group: Any,
                  ep_size: int) -> torch.Tensor:
    """Send `rows` (sorted by global expert id) to the EP ranks owning their experts, run
    `compute(received_rows, local_expert_ids)` there and bring the results back in `rows`' order
    ([Note: AutoEP dispatch]). ep_size 1: computed here; the ids are local already."""
    if ep_size == 1:
        return compute(rows, expert_ids)
    got = _AllToAll.apply(rows, plan.input_splits, plan.output_splits, group)
    out = compute(got, local_ids_by_source(plan.local_counts_by_source))
    return _AllToAll.apply(out, plan.output_splits, plan.input_splits, group)


class _WholeExpertState:
    """state_dict() holds whole expert tensors, every EP rank's experts in order (collective over the
    EP group), except with keep_vars or inside local_expert_state(); load_state_dict takes whole
    tensors (keeping this rank's experts) or this rank's slice. Needs expert_param_names(),
    num_experts, num_local_experts, first_expert, ep_size, ep_group; call _whole_expert_state()."""

    tensor_fold: Optional[tuple] = None   # (tensor group, size, rank) under AutoTP: [Note: EP x TP folding]
    folding_group_handles: Any = None   # auto_ep_folding.FoldingGroupHandles under AutoTP (upstream's attribute)
    tp_group: Any = None
    validate_folding_routing = False   # the section's key: check the tensor peers' routing before dispatching

    def _whole_expert_state(self) -> None:
        self._register_state_dict_hook(_WholeExpertState._gather_hook)
        self._register_load_state_dict_pre_hook(self._slice_hook)

    def full_param(self, name: str) -> torch.Tensor:
        """The whole tensor of expert parameter `name` (dim 0 over all experts). Collective over the EP group."""
        local = self.get_parameter(name).detach().contiguous()
        if self.ep_size == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(self.ep_size)]
        ds_comm.all_gather(parts, local, group=self.ep_group)
        return torch.cat(parts)

    @staticmethod
    def _gather_hook(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        if getattr(_LOCAL, "on", False):
            return
        for name in module.expert_param_names():
            if not isinstance(state_dict.get(prefix + name), nn.Parameter):   # keep_vars: the Parameter itself
                state_dict[prefix + name] = module.full_param(name)

    def _slice_hook(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in self.expert_param_names():
            value = state_dict.get(prefix + name)
            if value is not None and value.dim() >= 1 and value.shape[0] == self.num_experts != self.num_local_experts:
                state_dict[prefix + name] = value[self.first_expert:self.first_expert + self.num_local_experts]


class ExpertParallelExperts(_WholeExpertState, nn.Module):
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
        self._whole_expert_state()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine's MoE set-up calls this; the groups were built when the block was swapped."""

    def expert_param_names(self) -> tuple[str, ...]:
        """This rank's expert tensors (dim 0: its local experts), for the MoE checkpoint files."""
        return (self._w1, self._w2)

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
        if self.tensor_fold is not None:   # [Note: folded assignment dispatch] in moe/ep_tp_dispatch.py
            group, tp, _ = self.tensor_fold
            x = sum_gradient_over_tp(hidden_states, group, tp)
            weights = sum_gradient_over_tp(top_k_weights, group, tp)[token, slot]
            payload = payload_from_routing(token, slot, expert, weights, hidden_states.shape[0], self.ep_size,
                                           self.num_local_experts)
            def compute(local: Any, _rows: torch.Tensor) -> torch.Tensor:
                return dispatch_sorted(self, x[local.token_indices], local.expert_indices)

            out = fold_dispatch(payload, self.tensor_fold, compute, self.validate_folding_routing)
            return out.to(hidden_states.dtype)
        out = dispatch_sorted(self, hidden_states[token], expert)
        out = out * top_k_weights[token, slot, None]
        return torch.zeros_like(hidden_states).index_add(0, token, out.to(hidden_states.dtype))


def dispatch_sorted(layer: Any, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """`layer`'s expert outputs of `rows`, sorted by their global expert ids `expert` ([Note: AutoEP dispatch])."""
    plan = compute_split_plan_from_expert_indices(expert, layer.num_experts, layer.ep_size, layer.num_local_experts,
                                                  layer.ep_group)
    return run_on_owners(rows, expert, plan, layer._compute, layer.ep_group, layer.ep_size)


def autoep_layers(module: nn.Module) -> list[nn.Module]:
    """The module's AutoEP layers of either kind (experts swapped, or whole blocks replaced)."""
    return [m for m in module.modules() if isinstance(m, (ExpertParallelExperts, AutoEPMoELayer))]


# -- whole-block replacement (AutoEP class, auto_ep.py) -------------------------------------------
def resolve_score_apply_mode(spec: Any, config_override: str) -> str:
    """"pre" (weight rows before the experts) or "post" (weight expert outputs): the section's
    score_apply unless "auto", else the preset's."""
    return spec.score_apply if config_override == "auto" else config_override


def apply_scores_before_experts_if_enabled(routed_input: torch.Tensor, top_scores: torch.Tensor,
                                           score_apply: str) -> torch.Tensor:
    """Rows scaled by their routing weight (in fp32) when score_apply is "pre"; unchanged otherwise."""
    if score_apply != "pre":
        return routed_input
    return (routed_input.float() * top_scores.reshape(-1, 1)).to(routed_input.dtype)


def combine_from_routed(expert_output: torch.Tensor, top_scores: torch.Tensor, token_indices_sorted: torch.Tensor,
                        top_k: int, score_apply: str, combine_impl: str, shape: tuple) -> torch.Tensor:
    """Each token's output from its k expert rows: `expert_output[i]` belongs to flat (token, slot)
    `token_indices_sorted[i]`; "post" weights the k rows by top_scores (fp32) and sums them
    ("legacy_bmm": the same sum as one batched matmul), "pre" only sums. Returns `shape` (B, S, H)."""
    tokens = top_scores.shape[0]
    rows = expert_output.new_zeros((tokens * top_k, expert_output.shape[-1]))
    rows[token_indices_sorted] = expert_output
    rows = rows.view(tokens, top_k, -1)
    if score_apply == "post":
        weights = top_scores.reshape(tokens, top_k).float()
        if combine_impl == "legacy_bmm":
            out = torch.bmm(weights.unsqueeze(1), rows.float()).squeeze(1)
        else:
            out = (rows.float() * weights.unsqueeze(-1)).sum(dim=1)
        out = out.to(expert_output.dtype)
    else:
        out = rows.sum(dim=1)
    return out.reshape(shape)


def _mark(params: Iterator[nn.Parameter], family: str, group_name: Optional[str] = None) -> None:
    for p in params:
        p.allreduce = group_name is None
        p.ds_zero_placement_family = family
        if group_name is not None:
            p.group_name = p.ds_zero_partition_group_name = group_name


class AutoEPMoELayer(_WholeExpertState, nn.Module):
    """A whole MoE block replaced: the preset's routing (moe/ep_router.py), this EP rank's experts
    (moe/ep_experts.py, cut by moe/ep_repack.py), dispatch as [Note: AutoEP dispatch], and the
    block's shared experts kept as they are. For blocks that compute their experts themselves; Hugging
    Face Transformers 5.x blocks keep their own router under the engine's experts swap instead
    (ExpertParallelExperts). Expert parameters carry allreduce=False and group_name "ep_size_<ep>"."""

    _is_autoep_layer = True

    def __init__(self, spec: Any, source_module: nn.Module, ep_size: int, ep_rank: int, config: Any) -> None:
        super().__init__()
        from .auto_ep_presets.registry import resolve_autoep_config_defaults
        from ..moe.ep_experts import GroupedExperts
        from ..moe.ep_repack import gather_source_params, repack_expert_requires_grad_flags, repack_expert_weights
        from ..moe.ep_router import TokenChoiceTopKRouter

        coeff = resolve_autoep_config_defaults(config, spec.model_family).load_balance_coeff
        if coeff is not None:
            raise ValueError(f"AutoEP preset {spec.model_family!r} ({spec.moe_module_name}): "
                             f"load_balance_coeff/expert_bias (load_balance_coeff={coeff!r}) is not supported; set "
                             "load_balance_coeff to null or omit the key")
        if spec.num_experts % ep_size:
            raise ValueError(f"AutoEP: {spec.moe_module_name} has {spec.num_experts} experts, which autoep_size="
                             f"{ep_size} does not divide")
        self.model_family, self.top_k, self.num_experts = spec.model_family, spec.top_k, spec.num_experts
        self.ep_size, self.ep_rank, self.num_local_experts = ep_size, ep_rank, spec.num_experts // ep_size
        self.hidden_size, self.ep_group_name, self.ep_group = spec.hidden_size, f"ep_size_{ep_size}", None
        self.expert_group_name, self.first_expert = self.ep_group_name, ep_rank * self.num_local_experts
        self.score_apply = resolve_score_apply_mode(spec, config.score_apply)
        self.combine_impl = "weighted_sum" if config.combine_impl == "auto" else config.combine_impl
        gate = getattr(source_module, spec.router_name)
        bias = getattr(gate, "bias", None)
        correction = getattr(gate, "e_score_correction_bias", None)
        self.router = TokenChoiceTopKRouter(spec.hidden_size, spec.num_experts, spec.num_expert_groups,
                                            spec.num_limited_groups, spec.top_k, spec.score_func,
                                            spec.route_norm if config.route_norm is None else bool(config.route_norm),
                                            spec.route_scale, bias is not None, spec.group_score_func)
        self.router.to(dtype=gate.weight.dtype, device=gate.weight.device)
        with gather_source_params([gate.weight, bias, correction]), torch.no_grad():
            for mine, theirs in ((self.router.gate.weight, gate.weight), (self.router.gate.bias, bias)):
                if theirs is not None:
                    mine.copy_(theirs.detach().reshape(mine.shape))
                    mine.requires_grad_(theirs.requires_grad)
            if correction is not None:
                value = correction.detach().clone().reshape(spec.num_experts)
                if isinstance(correction, nn.Parameter):
                    self.router.e_score_correction_bias = nn.Parameter(value, requires_grad=correction.requires_grad)
                else:
                    self.router.register_buffer("e_score_correction_bias", value)
        self.router_alias = router_alias_name(spec, self)   # [Note: AutoEP router alias]
        if self.router_alias is not None:
            self._register_state_dict_hook(add_alias_entries)
            self._register_load_state_dict_pre_hook(self._drop_router_alias)
        source_experts = getattr(source_module, spec.experts_name)
        weights = repack_expert_weights(source_experts, spec, ep_rank, ep_size)
        flags = repack_expert_requires_grad_flags(source_experts, spec, ep_rank, ep_size)
        self.experts = GroupedExperts(spec.hidden_size, spec.ffn_hidden_size, self.num_local_experts,
                                      config.use_grouped_mm, spec.expert_activation, dtype=weights[0].dtype,
                                      device=weights[0].device)
        with torch.no_grad():
            for param, value, flag in zip((self.experts.w1, self.experts.w2, self.experts.w3), weights, flags):
                param.copy_(value)
                param.requires_grad_(flag)
        self.shared_experts = getattr(source_module, spec.shared_experts_name) if spec.has_shared_experts else None
        self.shared_experts_gate = (getattr(source_module, spec.shared_experts_gate_name, None)
                                    if spec.has_shared_experts and spec.shared_experts_gate_name else None)
        _mark(self.experts.parameters(), "autoep_expert", self.ep_group_name)
        self._whole_expert_state()
        for dense in (self.router, self.shared_experts, self.shared_experts_gate):
            if dense is not None:
                _mark(dense.parameters(), "replicated")
        for param in self.router.parameters():   # "average" over the tensor peers (auto_ep_folding)
            mark_autoep_folding_router_parameter(param)

    def _drop_router_alias(self, state_dict: dict, prefix: str, *args: Any) -> None:
        drop_alias_entries(state_dict, prefix, self.router_alias)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles: Any = None) -> None:
        """Build (or find) the `ep_size_<ep>` expert groups and take this rank's EP group; with
        `folding_group_handles` (auto_ep_folding.FoldingGroupHandles) take its groups, and under
        tp > 1 share the assignments with its tensor group ([Note: folded assignment dispatch])."""
        from ..utils import groups

        if folding_group_handles is not None:
            handles = folding_group_handles
            self.folding_group_handles, self.ep_group, self.tp_group = handles, handles.ep_group, handles.tp_group
            self.ep_group_name = self.expert_group_name = handles.ep_group_name
            tp = int(handles.spec.tp_size)
            self.tensor_fold = (handles.tp_group, tp, ds_comm.get_rank(group=handles.tp_group)) if tp > 1 else None
            return
        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.ep_group_name)

    def expert_param_names(self) -> tuple[str, ...]:
        """This rank's expert tensors (dim 0: its local experts), for the MoE checkpoint files."""
        return ("experts.w1", "experts.w2", "experts.w3")

    def _compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        order, counts = group_by_expert(local_ids, self.num_local_experts)
        return self.experts(rows[order], counts)[inverse_permutation(order)]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"AutoEPMoELayer (autoep_size={self.ep_size}): call set_deepspeed_parallelism() "
                               "(deepspeed.initialize does) before the forward")
        full = hidden_states.reshape(-1, hidden_states.shape[-1])
        top_scores, selected, counts = self.router(full)
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if self.tensor_fold is not None:   # [Note: folded assignment dispatch] in moe/ep_tp_dispatch.py
            out = self._folded(full, top_scores, flat, order)
        else:
            rows = apply_scores_before_experts_if_enabled(full[order // self.top_k], top_scores.reshape(-1)[order],
                                                          self.score_apply)
            plan = compute_split_plan(selected, self.num_experts, self.ep_size, self.num_local_experts, self.ep_group,
                                      counts)
            out = run_on_owners(rows, flat[order], plan, self._compute, self.ep_group, self.ep_size)
            out = combine_from_routed(out, top_scores, order, self.top_k, self.score_apply, self.combine_impl,
                                      full.shape)
        if self.shared_experts is not None:
            shared = self.shared_experts(full)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(full)) * shared
            out = out + shared
        return out.reshape(hidden_states.shape)

    def _folded(self, full: torch.Tensor, top_scores: torch.Tensor, flat: torch.Tensor,
                order: torch.Tensor) -> torch.Tensor:
        """The routed experts' output when the tensor peers share the assignments ([Note: folded
        assignment dispatch]): every peer routes every token, dispatches its share, and the shares'
        outputs are combined on every peer. "pre" scores weight the rows, so the combine weight is 1."""
        group, tp, _ = self.tensor_fold
        x = sum_gradient_over_tp(full, group, tp)
        scores = sum_gradient_over_tp(top_scores, group, tp).reshape(-1)[order]
        weights = scores if self.score_apply == "post" else torch.ones_like(scores)
        payload = payload_from_routing(order // self.top_k, order % self.top_k, flat[order], weights, full.shape[0],
                                       self.ep_size, self.num_local_experts)

        def compute(local: Any, rows: torch.Tensor) -> torch.Tensor:
            routed = apply_scores_before_experts_if_enabled(x[local.token_indices], scores[rows], self.score_apply)
            return dispatch_sorted(self, routed, local.expert_indices)

        return fold_dispatch(payload, self.tensor_fold, compute, self.validate_folding_routing)
