# compat: upstream path deepspeed.moe.utils (DeepSpeed 0.19.8 names).
"""Parameter-group helpers for mixture-of-experts models.

Expert parameters are marked `allreduce=False` (they are reduced over their expert-parallel group,
not the whole data-parallel group) and carry `group_name`. This build has no expert parallelism
(deepspeed.moe.layer.MoE says so), but these helpers are plain functions over parameter
attributes and work on any model: without expert parameters they return the groups unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (marked `allreduce=False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list[torch.nn.Parameter]) -> tuple[list, list]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: list[torch.nn.Parameter]) -> tuple[list, list]:
    """The gradients of `group`'s parameters that have one, shared and expert apart."""
    shared = [p.grad for p in group if p.grad is not None and not is_moe_param(p)]
    expert = [p.grad for p in group if p.grad is not None and is_moe_param(p)]
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = 178956971
                                                         ) -> list[dict]:
    """Optimizer param groups with each group's expert parameters moved into groups of their own
    (one per expert `group_name`, flagged `moe: True`), as upstream's engine needs them. Accepts a
    group dict, a list or tuple of group dicts; returns a list of group dicts. `max_group_size`
    (elements) splits large expert groups, as upstream does."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)) and all(isinstance(g, dict) for g in param_groups):
        groups = list(param_groups)
    else:
        raise ValueError(f"param_groups must be a dict or a list of dicts, got {type(param_groups).__name__}")
    out: list[dict] = []
    expert_groups: list[dict] = []
    for group in groups:
        params = list(group["params"])
        shared = [p for p in params if not is_moe_param(p)]
        out.append({**group, "params": shared})
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", "expert"), []).append(p)
        for name, members in by_name.items():
            chunks, current, size = [], [], 0
            for p in members:
                if current and max_group_size is not None and size + p.numel() > max_group_size:
                    chunks.append(current)
                    current, size = [], 0
                current.append(p)
                size += p.numel()
            chunks.append(current)
            for chunk in chunks:
                expert_groups.append({**group, "params": chunk, "name": name, "moe": True})
    return out + expert_groups


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))
