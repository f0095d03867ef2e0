"""AutoEP: swap the experts of a Hugging Face MoE model's blocks for expert-parallel ones
(auto_ep_plan.py decides which, auto_ep_layer.py runs them). Used by the engine when the config's
`expert_parallel` section is enabled (runtime/engine_autoep.py); callable directly as well."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import comm as ds_comm
from .auto_ep_layer import ExpertParallelExperts, autoep_layers
from .auto_ep_plan import BlockPlan, build_plan


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _broadcast(t: torch.Tensor, src: int, group: Any) -> None:
    """Broadcast in place; a host tensor travels through the accelerator under a device backend
    (the engine moves the module to its device only after the swap)."""
    buf = t
    if t.device.type == "cpu" and ds_comm.get_backend(group) != "gloo":
        from ..accelerator import get_accelerator

        buf = t.to(get_accelerator().current_device_name())
    ds_comm.broadcast(buf, src=src, group=group)
    if buf is not t:
        t.copy_(buf)


def apply_autoep(model: nn.Module, section: dict, ep_size: int, *, broadcast_group: Any = None,
                 use_data_before_expert_parallel: bool = False) -> list[BlockPlan]:
    """Shard `model`'s MoE experts over `ep_size` ranks in place ([Note: the AutoEP plan]); returns
    the plan. Collective (every rank, same arguments): builds the `ep_size_<ep>` expert groups and
    first broadcasts each fused expert tensor from the first rank of `broadcast_group` (the whole
    world when None), so every EP rank cuts its slice from the same experts, as AutoTP does. A model
    already swapped for this `ep_size` is left as it is."""
    done = autoep_layers(model)
    if done:
        if any(layer.ep_size != ep_size for layer in done):
            raise ValueError(f"expert_parallel.autoep_size={ep_size} but the model's experts are already "
                             f"sharded for ep_size {sorted({layer.ep_size for layer in done})}")
        return []
    plans = build_plan(model, section, ep_size)
    from ..utils import groups

    world = ds_comm.get_world_size()
    if world % ep_size:
        raise ValueError(f"expert_parallel.autoep_size={ep_size} must divide the world size {world}")
    groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel)
    name = f"ep_size_{ep_size}"
    group, rank = groups._get_expert_parallel_group(name), groups._get_expert_parallel_rank(name)
    src = ds_comm.get_global_rank(broadcast_group, 0) if broadcast_group is not None else 0
    for plan in plans:
        original = model.get_submodule(plan.experts_name)
        if ds_comm.get_world_size(broadcast_group) > 1:
            for w in (plan.w1, plan.w2):
                _broadcast(getattr(original, w).data, src, broadcast_group)
        _set_child(model, plan.experts_name,
                   ExpertParallelExperts(original, plan.w1, plan.w2, plan.num_experts, ep_size, rank, group))
    return plans
