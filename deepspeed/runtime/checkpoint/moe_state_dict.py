"""Upstream's static `DeepSpeedEngine.load_moe_state_dict` and `_get_expert_ckpt_name`.

Megatron-DeepSpeed's checkpointing (and its conversion tools) call these without an engine: the
first names the file of one expert (`layer_{L}_expert_{E}_mp_rank_XX_model_states.pt`, or the
pre-layer-id `expert_{E}_...` of old checkpoints), the second fills a module state dict with this
rank's experts read from those files: `deepspeed.moe` experts under their LOCAL ids (the files hold
them under GLOBAL ids), AutoEP's fused expert tensors stacked from their per-expert rows. Layer ids
count the model's MoE layers in registration order, as the writer does ([Note: MoE checkpoint
layout] in moe_io.py). A checkpoint in the ZeRO-3 AutoEP layout has no expert files (the experts
are in the ZeRO-3 files): load it with `engine.load_checkpoint`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

from ...checkpoint.files import CheckpointError, expert_file, load_file

AUTOEP_LAYER_FIELDS = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size")


def expert_ckpt_name(checkpoints_path: str, layer_id: int, expert_id: int, tag: Any, mpu: Any = None,
                     checkpoint_mp_rank: int | None = None) -> str:
    """The file of expert `expert_id` of MoE layer `layer_id` (`layer_id` <= -1: an old checkpoint's
    `expert_{E}_...`, written before layer ids); the model-parallel rank from `mpu` unless given."""
    mp = _mp_rank(mpu, checkpoint_mp_rank)
    name = f"expert_{expert_id}_mp_rank_{mp:02d}_model_states.pt" if layer_id <= -1 else \
        expert_file(layer_id, expert_id, mp)
    return os.path.join(checkpoints_path, "" if tag is None else str(tag), name)


def validate_autoep_layers(autoep_layers: Any) -> None:
    """A model-states file's `ds_autoep_layers`: a list of records, each with AUTOEP_LAYER_FIELDS."""
    if not isinstance(autoep_layers, list) or not all(isinstance(e, dict) for e in autoep_layers):
        raise RuntimeError(f"ds_autoep_layers metadata is malformed: expected a list of per-layer records (dicts), "
                           f"got {type(autoep_layers).__name__} {autoep_layers!r:.80}")
    for entry in autoep_layers:
        missing = [k for k in AUTOEP_LAYER_FIELDS if k not in entry]
        if missing:
            raise RuntimeError(f"ds_autoep_layers record {entry!r} is missing fields {missing}; every record "
                               f"needs {list(AUTOEP_LAYER_FIELDS)}")


def load_moe_state_dict(checkpoint_path: str, tag: Any, state_dict: dict, old_moe_load: bool, model: Any = None,
                        mpu: Any = None, num_experts: Any = 1, checkpoint_engine: Any = None, autoep_layers: Any = None,
                        folding_spec: Any = None, checkpoint_mp_rank: int | None = None) -> None:
    """Add this rank's experts of `model` to `state_dict` from the expert files under
    `checkpoint_path/tag` (upstream's signature; `folding_spec` is read from the files' own layout)."""
    from ...utils import groups
    from ..engine_moe import moe_layers

    mp = _mp_rank(mpu, checkpoint_mp_rank)
    if autoep_layers is not None:
        validate_autoep_layers(autoep_layers)

    def load(path: str) -> dict:
        if not os.path.isfile(path):
            raise CheckpointError(f"load_moe_state_dict: no expert file {path}")
        if checkpoint_engine is not None:
            return checkpoint_engine.load(path, map_location=torch.device("cpu"))  # host: a file read, as upstream
        return load_file(path)

    layers = moe_layers(model) if model is not None else []
    if old_moe_load:
        if any(_is_autoep(layer) for _, layer in layers):
            raise RuntimeError("load_moe_state_dict: the legacy expert files (old_moe_load=True) cannot fill AutoEP "
                               "layers; convert the checkpoint with ds_to_universal first")
        name = groups._get_max_expert_size_name()
        counts = num_experts if isinstance(num_experts, (list, tuple)) else [num_experts]
        local = max(counts) // groups._get_expert_parallel_world_size(name)
        first = groups._get_expert_parallel_rank(name) * local
        for j in range(local):
            state_dict.update(_to_local(load(expert_ckpt_name(checkpoint_path, -1, first + j, tag, None, mp)),
                                        first + j, j))
        return
    if model is None:
        raise ValueError("load_moe_state_dict: model= is required (its MoE layers say which experts to read)")
    path = os.path.join(checkpoint_path, "" if tag is None else str(tag))
    for layer_id, (prefix, layer) in enumerate(layers):
        if _is_autoep(layer):
            from .autoep_io import autoep_params, module_rows

            params = {n: v for n, v in autoep_params(SimpleNamespace(module=model)).items() if v[1] is layer}
            rows = module_rows(path, {n: (layer_id, v[1]) for n, v in params.items()}, mp)
            state_dict.update({n: torch.stack(r) for n, r in rows.items()})
            continue
        local = int(layer.num_local_experts)
        first = groups._get_expert_parallel_rank(layer.expert_group_name) * local
        for j in range(local):
            state_dict.update(_to_local(load(expert_ckpt_name(checkpoint_path, layer_id, first + j, tag, None, mp)),
                                        first + j, j))


def _mp_rank(mpu: Any, checkpoint_mp_rank: int | None) -> int:
    if checkpoint_mp_rank is not None:
        return int(checkpoint_mp_rank)
    return 0 if mpu is None else int(mpu.get_model_parallel_rank())


def _is_autoep(layer: Any) -> bool:
    return hasattr(layer, "expert_param_names")


def _to_local(saved: dict, global_id: int, local_id: int) -> dict:
    """An expert file's entries with the expert's global id in their names replaced by its local id."""
    from .moe_io import EXPERT_RE

    out = {}
    for key, value in saved.items():
        match = EXPERT_RE.match(key)
        out[f"{match.group(1)}{local_id}{match.group(3)}" if match and int(match.group(2)) == global_id
            else key] = value
    return out
