"""AutoEP experts in the MoE checkpoint layout ([Note: MoE checkpoint layout] in moe_io.py).

An AutoEP experts module holds a contiguous slice [first, first + L) of each fused HF tensor
(gate_up_proj, down_proj). In the checkpoint each expert is one file, as upstream's layout:
`layer_{layer}_expert_{e}_mp_rank_00_model_states.pt` holds `<block>.experts.gate_up_proj` and
`...down_proj` of expert e ([2I, H], [H, I]), written by the first rank of each expert-data-parallel
group. Optimizer pieces are named by the whole tensor (the HF name) with offsets into it, so a
reader at any ep_size joins them and keeps its own experts' rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...checkpoint.files import CheckpointError
from .view import CheckpointView


class ExpertCountError(CheckpointError, ValueError):
    """A checkpoint with another number of experts per AutoEP layer than the model (upstream raises a
    ValueError there)."""


def autoep_params(view: CheckpointView) -> dict[str, tuple[int, Any]]:
    """{parameter name: (MoE layer id, its AutoEP experts module)}: empty without AutoEP."""
    from ..engine_moe import moe_layers

    out = {}
    for layer_id, (prefix, layer) in enumerate(moe_layers(view.module)):
        if hasattr(layer, "expert_param_names"):   # auto_ep_layer's two kinds
            for name in layer.expert_param_names():
                out[f"{prefix}.{name}" if prefix else name] = (layer_id, layer)
    return out


def layer_metadata(view: CheckpointView) -> list[dict]:
    """DeepSpeed's `ds_autoep_layers` entry of the model-states file: each AutoEP layer's MoE block
    (module_path), where its expert tensors live (expert_key_prefix) and its expert split."""
    from ..engine_moe import moe_layers

    out = []
    for layer_id, (prefix, layer) in enumerate(moe_layers(view.module)):
        if hasattr(layer, "expert_param_names"):
            whole_block = getattr(layer, "_is_autoep_layer", False)   # AutoEPMoELayer; else the experts child
            block = prefix if whole_block else prefix.rpartition(".")[0]
            out.append({"moe_layer_id": layer_id, "module_path": block,
                        "expert_key_prefix": f"{prefix}.experts" if whole_block else prefix,
                        "num_experts": layer.num_experts, "num_local_experts": layer.num_local_experts,
                        "ep_size": layer.ep_size})
    return out


def expert_entries(view: CheckpointView, params: dict[str, tuple[int, Any]],
                   values: dict[str, torch.Tensor] | None = None) -> list[tuple[tuple[int, int], dict]]:
    """This rank's per-expert files as ((MoE layer id, global expert id), content), on the first rank of
    each expert-data-parallel group; `values`: the parameters' gathered local values by name (ZeRO-3,
    where the parameters are placeholders)."""
    from ...utils import groups

    named = dict(view.module.named_parameters())
    files: dict[tuple[int, int], dict] = {}
    for name, (layer_id, layer) in params.items():
        if groups._get_expert_data_parallel_rank(layer.expert_group_name) != 0:
            continue
        local = values[name] if values is not None else named[name].detach().cpu()
        for j in range(layer.num_local_experts):
            files.setdefault((layer_id, layer.first_expert + j), {})[name] = local[j].clone()
    return sorted(files.items())


def piece_in_whole(params: dict[str, tuple[int, Any]], name: str, shape: tuple, start: int) -> tuple[int, tuple]:
    """Where a piece of this rank's slice (of local `shape`) lies in the whole HF tensor: (offset, whole shape)."""
    layer = params[name][1]
    per_expert = torch.Size(shape[1:]).numel()
    return layer.first_expert * per_expert + start, (layer.num_experts,) + tuple(shape[1:])


def whole_rows(layer: Any, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor (every EP rank's experts, in order) from this EP rank's `local` rows.
    Collective over the layer's EP group."""
    from ... import comm as ds_comm

    if layer.ep_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
    ds_comm.all_gather(parts, local.contiguous(), group=layer.ep_group)
    return torch.cat(parts)


def module_rows(path: str, params: dict[str, tuple[int, Any]], mp: int = 0) -> dict[str, list[torch.Tensor]]:
    """This rank's slices from the per-expert files (any ep_size wrote them; under tensor parallelism
    the layout that saved: [Note: EP x TP checkpoint layout]), one memory-mapped row per local expert."""
    from ...checkpoint.files import CheckpointError, load_file
    from .ep_tp_io import expert_source

    out = {}
    for name, (layer_id, layer) in params.items():
        rows = []
        for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts):
            source = expert_source(path, layer_id, e, mp)
            if not os.path.isfile(source):
                raise CheckpointError(f"{path}: no {os.path.basename(source)} for AutoEP expert {e} of {name}")
            saved = load_file(source)
            key = name if name in saved else f"{name}.{e}"   # ours, or DeepSpeed's (keyed by the global id)
            if key not in saved:
                raise CheckpointError(f"{source} has no {name!r} nor {key!r} (it holds {sorted(saved)})")
            rows.append(saved[key])
        out[name] = rows
    return out


def check_expert_counts(view: CheckpointView, reader: Any) -> None:
    """Refuse a checkpoint whose AutoEP layers hold another number of experts than this model's, by the
    saved shape of the MoE block's router, before the shape checks that would name only the router
    (a ValueError, as upstream's refusal, worded as upstream's)."""
    from ..engine_moe import moe_layers

    saved = {n: torch.Size(s) for g in reader.groups() for n, s in g}
    experts = autoep_params(view)
    for prefix, layer in moe_layers(view.module):
        if not hasattr(layer, "expert_param_names"):
            continue
        block = prefix if getattr(layer, "_is_autoep_layer", False) else prefix.rpartition(".")[0]
        module = view.module.get_submodule(block) if block else view.module
        for name, param in module.named_parameters():
            full = f"{block}.{name}" if block else name
            shape, mine = saved.get(full), getattr(param, "ds_shape", param.shape)
            if full in experts or shape is None or len(shape) != 2 or len(mine) != 2 or mine[0] != layer.num_experts:
                continue
            if shape[0] != mine[0] and shape[1] == mine[1]:
                raise ExpertCountError(
                    f"{reader.path}: AutoEP layer {block!r} was saved with {shape[0]} experts (its router "
                    f"{full} is {tuple(shape)}); this model has {layer.num_experts} at ep_size {layer.ep_size} "
                    f"(target_local_experts={layer.num_local_experts}, "
                    f"checkpoint_local_experts={shape[0] // layer.ep_size}): load it into a model with "
                    f"{shape[0]} experts")


def drop_router_aliases(view: CheckpointView, module: dict, source: str = "state dict") -> dict:
    """`module` (a module state: saved, or this model's own) without the router aliases of whole-block AutoEP
    layers ([Note: AutoEP router alias] in module_inject/auto_ep_alias.py): an alias entry equal to the
    router's is dropped, one alone is taken as the router's, one that differs raises (naming it and `source`).
    The same rule for every checkpoint layout, so a strict load neither calls the alias unexpected nor misses
    it in an older file."""
    from ...module_inject.auto_ep_alias import drop_alias_entries
    from ..engine_moe import moe_layers

    out = dict(module)
    for prefix, layer in moe_layers(view.module):
        alias = getattr(layer, "router_alias", None)
        if alias is not None:
            drop_alias_entries(out, f"{prefix}." if prefix else "", alias, source)
    return out


def without_router_aliases(view: CheckpointView, reader: Any) -> Any:
    """`reader` with its module state's router aliases dropped (drop_router_aliases; the reader itself when
    there are none)."""
    from ..engine_moe import moe_layers

    states = getattr(reader, "model_states", None) or {}
    module = states.get("module") or {}
    if not module or all(getattr(layer, "router_alias", None) is None for _, layer in moe_layers(view.module)):
        return reader
    kept = drop_router_aliases(view, module, getattr(reader, "path", "checkpoint"))
    if list(kept) != list(module):
        reader.model_states = dict(states, module=kept)
    return reader
