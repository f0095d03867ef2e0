"""Cut one EP rank's experts out of a Hugging Face experts module into AutoEP's stacked layout
(w1 gate [E_local, F, H], w2 down [E_local, H, F], w3 up [E_local, F, H]), from either storage:
fused 3-D tensors (Transformers 5.x gate_up_proj/down_proj, in either orientation,
moe/fused_expert_layout.py) or an nn.ModuleList of per-expert MLPs. Source parameters partitioned
by ZeRO-3 (they carry `ds_id`) are gathered for the copy, never modified (modifier_rank None).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..runtime.zero.stage3.gathered import GatheredParameters
from .fused_expert_layout import classify_fused_gate_up_layout


def gather_source_params(params: Iterable[Optional[torch.Tensor]]) -> Any:
    """A context in which the ZeRO-3 partitioned ones among `params` are whole (None: nothing to do)."""
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    return GatheredParameters(partitioned, modifier_rank=None) if partitioned else contextlib.nullcontext()


def local_expert_range(spec: Any, ep_rank: int, ep_size: int) -> range:
    local = spec.num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


def _expert_weight(expert: nn.Module, name: str) -> torch.Tensor:
    value = getattr(expert, name, None)
    if isinstance(value, nn.Module):
        value = getattr(value, "weight", None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"AutoEP: expert module {type(expert).__name__} has no weight {name!r}")
    return value


def _require_uniform(name: str, weights: list[torch.Tensor]) -> None:
    if len({(w.dtype, w.device) for w in weights}) > 1:
        raise ValueError(f"AutoEP: experts' {name} weights have mixed dtype/device "
                         f"{sorted({(str(w.dtype), str(w.device)) for w in weights})}; cast the experts alike first")
    if len({w.requires_grad for w in weights}) > 1:
        raise ValueError(f"AutoEP: experts' {name} weights have mixed requires_grad flags; the stacked AutoEP weight "
                         "has one flag: freeze all experts or none")


def source_weights(experts: nn.Module, spec: Any) -> list[list[torch.Tensor]]:
    """The source tensors behind w1, w2, w3 (fused: [[gate_up], [down], [gate_up]] or with a
    separate w3; module list: one tensor per expert each)."""
    names = (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name)
    if spec.expert_storage == "module_list":
        groups = [[_expert_weight(e, n) for e in experts] for n in names]
        for n, ws in zip(names, groups):
            _require_uniform(n, ws)
        return groups
    w1, w2 = getattr(experts, names[0]), getattr(experts, names[1])
    return [[w1], [w2], [getattr(experts, names[2]) if names[2] else w1]]


def repack_expert_weights(experts_source: nn.Module, spec: Any, ep_rank: int,
                          ep_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w2, w3) of EP rank `ep_rank`'s experts, copies in AutoEP's layout."""
    keep = local_expert_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "module_list":
        names = (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name)
        source_weights(experts_source, spec)   # uniformity checks
        stacks: list[list[torch.Tensor]] = [[], [], []]
        for e, expert in enumerate(experts_source):   # every expert, in global order: a collective gather
            ws = [_expert_weight(expert, n) for n in names]
            with gather_source_params(ws):
                if e in keep:
                    for stack, w in zip(stacks, ws):
                        stack.append(w.detach().clone())
        return tuple(torch.stack(s) for s in stacks)
    w1, w2 = getattr(experts_source, spec.expert_w1_name), getattr(experts_source, spec.expert_w2_name)
    w3 = getattr(experts_source, spec.expert_w3_name) if spec.expert_w3_name else None
    with gather_source_params([w1, w2, w3]):
        part = slice(keep.start, keep.stop)
        if w3 is not None:
            return tuple(w.detach()[part].clone() for w in (w1, w2, w3))
        layout = classify_fused_gate_up_layout(tuple(w1.shape), tuple(w2.shape))
        if layout is None:
            raise ValueError(f"AutoEP: {spec.moe_module_name}.{spec.experts_name}: fused {spec.expert_w1_name} "
                             f"{tuple(w1.shape)} / {spec.expert_w2_name} {tuple(w2.shape)} fit neither "
                             "[E, 2F, H]/[E, H, F] nor [E, H, 2F]/[E, F, H]")
        gate_up, down = w1.detach()[part], w2.detach()[part]
        if layout.needs_transpose:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        gate, up = gate_up.chunk(2, dim=1)
        return gate.contiguous().clone(), down.contiguous().clone(), up.contiguous().clone()


def repack_expert_requires_grad_flags(experts_source: nn.Module, spec: Any, ep_rank: int,
                                      ep_size: int) -> tuple[bool, bool, bool]:
    """requires_grad of w1, w2, w3 (each the source's; an error when experts disagree)."""
    return tuple(ws[0].requires_grad for ws in source_weights(experts_source, spec))
