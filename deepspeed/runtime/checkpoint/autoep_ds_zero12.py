"""DeepSpeed 0.19.8's ZeRO-1/2 AutoEP optimizer files read as named pieces ([Note: MoE checkpoint layout]).

[Note: DeepSpeed's ZeRO-1/2 AutoEP optimizer files]
Upstream's AutoEP engine splits each optimizer group into its dense parameters and its experts (a group
with `moe: True`, named after the EP group), and each rank's `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
holds, per group, one flat fp32 partition (`single_partition_of_fp32_groups`) and the torch optimizer's
state of that flat (`base_optimizer_state`). The flats follow DeepSpeed's ZeRO-1/2 rule
(checkpoint/description.py, kind "flat": the group's parameters back to back in the order of the model
file's `param_shapes`, padded to a multiple of 2 x N, cut in N equal shards), where N is the group's
`partition_count`: the data-parallel size for a dense group, the expert-data-parallel size for an expert
group, whose parameters are the saving EP rank's rows `[num_local_experts, ...]` of each fused expert
tensor. Rank r's EP rank and EDP position follow upstream's group rule (autoep_universal.
autoep_zero12_dp_ranks). `pieces_of` turns each file into the `ds_moe_pieces` form this build writes (each
run named by its whole tensor, with its offset in it, views of the memory-mapped flats), so
MoECheckpointReader reads it at any ep_size as it reads ours. Anything the rule does not fix exactly (a
flat of another length, a group mixing dense and expert parameters, expert groups at another size than
the layers record, tensor parallelism, a dynamic loss scale, different steps) is refused naming the file.

DeepSpeed's own `deepspeed.moe` layers at ZeRO-1/2 write the same files (groups from
`split_params_into_different_moe_groups_for_optimizer`), except that each expert is its own tensors,
named in `param_shapes` by the saving rank's LOCAL ids (`...deepspeed_experts.{j}...`): the layers are the
expert prefixes in order (the model file's `num_experts`), a layer's ep_size is its experts over the local
ids listed, and EP rank e's local expert j is global expert e * num_local + j, the name its pieces get.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ...checkpoint.autoep_universal import autoep_zero12_dp_ranks
from ...checkpoint.constants import AUTOEP_LAYERS_KEY
from ...checkpoint.description import Description
from ...checkpoint.files import CheckpointError

FLATS, BASE = "single_partition_of_fp32_groups", "base_optimizer_state"


EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")   # deepspeed.moe's per-expert naming


def is_deepspeed_zero12(model_states: dict, states: list[dict]) -> bool:
    """Whether `states` (a tag's optimizer files) are upstream's ZeRO-1/2 flats of an AutoEP or a
    `deepspeed.moe` checkpoint."""
    return bool(model_states.get(AUTOEP_LAYERS_KEY) or model_states.get("num_experts")) and bool(states) and \
        all(FLATS in s.get("optimizer_state_dict", {}) for s in states)


def _moe_experts(path: str, model_states: dict) -> dict[str, dict]:
    """{local expert tensor name: its layer's ep_size, num_local_experts and the name's parts} of a
    `deepspeed.moe` checkpoint: the layers are the expert prefixes in order of `param_shapes`."""
    layers: dict[str, set] = {}
    matches = {}
    for g in model_states["param_shapes"]:
        for n in g:
            m = EXPERT.match(n)
            if m:
                matches[n] = m
                layers.setdefault(m.group(1), set()).add(int(m.group(2)))
    num_experts = list(model_states.get("num_experts") or [])
    if len(num_experts) != len(layers):
        raise CheckpointError(f"{path}: its model file records num_experts {num_experts} for {len(layers)} MoE "
                              f"layers in param_shapes ({sorted(layers)})")
    out = {}
    for (prefix, ids), total in zip(layers.items(), num_experts):
        local = len(ids)
        if ids != set(range(local)) or total % local:
            raise CheckpointError(f"{path}: MoE layer {prefix!r} lists local experts {sorted(ids)} of {total}; "
                                  f"DeepSpeed's ZeRO-1/2 flats hold local experts 0..L-1 with L dividing {total}")
        for n, m in matches.items():
            if m.group(1) == prefix:
                out[n] = {"ep_size": total // local, "num_local_experts": local, "module_path": prefix,
                          "parts": (m.group(1), int(m.group(2)), m.group(3))}
    return out


def _global(source: str, entry: dict, ep_rank: int, name: str, start: int, shape: tuple) -> tuple:
    """(name, start, shape) of saved EP rank `ep_rank`'s fragment of expert tensor `name` in the whole it
    belongs to: deepspeed.moe's expert under its global id, AutoEP's rows in the fused tensor."""
    local = int(entry["num_local_experts"])
    if "parts" in entry:
        head, j, tail = entry["parts"]
        return f"{head}{ep_rank * local + j}{tail}", start, shape
    if shape[0] != local:
        raise CheckpointError(f"{source}: {name} is {list(shape)}, its layer has {local} local experts")
    start += _first_expert(source, entry, ep_rank) * torch.Size(shape[1:]).numel()
    return name, start, (int(entry["num_experts"]),) + tuple(shape[1:])


def _experts(path: str, model_states: dict) -> dict[str, dict]:
    """{expert tensor name: its layer's `ds_autoep_layers` entry}, each name the layer's prefix + leaf
    (deepspeed.moe's checkpoints: _moe_experts)."""
    if not model_states.get(AUTOEP_LAYERS_KEY):
        return _moe_experts(path, model_states)
    out = {}
    for entry in model_states[AUTOEP_LAYERS_KEY]:
        if entry.get("checkpoint_format", "per_expert_files") != "per_expert_files":
            raise CheckpointError(f"{path}: AutoEP layer {entry.get('module_path')!r} has checkpoint_format "
                                  f"{entry['checkpoint_format']!r}; this ZeRO-1/2 reader reads 'per_expert_files'")
        prefix = entry["expert_key_prefix"]
        for g in model_states["param_shapes"]:
            out.update({n: entry for n in g if n.rpartition(".")[0] == prefix})
    return out


def _first_expert(where: str, entry: dict, ep_rank: int) -> int:
    """The global id of saved EP rank `ep_rank`'s first expert, from upstream's placement record."""
    local = int(entry["num_local_experts"])
    placed = [r["experts"] for r in (entry.get("expert_placement") or {}).get("ranks", []) if r["rank"] == ep_rank]
    first = ep_rank * local
    if placed and list(placed[0]) != list(range(first, first + local)):
        raise CheckpointError(f"{where}: AutoEP layer {entry['module_path']!r} places experts {placed[0]} on EP rank "
                              f"{ep_rank}; this reader reads contiguous placements ({first}..{first + local - 1})")
    return first


def _folded(source: str, saved: list[dict], count: int) -> list[dict]:
    """The saved param groups (without their params) as an optimizer of `count` groups has them: upstream's
    dense groups alone when this optimizer did not split off the experts, each expert group then checked to
    hold the hyperparameters of a dense group (else its values would be lost)."""
    plain = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    dense = [g for g in plain if not g.get("moe")]
    if not count or count == len(plain) or count != len(dense):
        return plain
    strip = lambda g: {k: v for k, v in g.items() if k not in ("name", "moe")}   # noqa: E731
    for g in plain:
        if g.get("moe") and strip(g) not in [strip(d) for d in dense]:
            raise CheckpointError(f"{source}: expert param group {g.get('name')!r} has hyperparameters no dense group "
                                  f"has ({strip(g)}); this optimizer has {count} groups, so it cannot keep them")
    return dense


def pieces_of(path: str, found: list[str], states: list[dict], model_states: dict, count: int = 0) -> list[dict]:
    """Each optimizer file of upstream's ZeRO-1/2 AutoEP tag as this build's piece state ([Note: DeepSpeed's
    ZeRO-1/2 AutoEP optimizer files]), its param groups folded for an optimizer of `count` groups; refuses
    what it cannot read exactly, naming the file."""
    dp = int(model_states.get("dp_world_size") or len(found))
    tp = (model_states.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1)
    if tp != 1 or int(model_states.get("mp_world_size") or 1) != 1:
        raise CheckpointError(f"{path}: DeepSpeed's ZeRO-1/2 MoE checkpoint saved with tensor parallelism "
                              f"(tp {tp}) is not read here; convert it with ds_to_universal")
    names = [os.path.basename(f) for f in found]
    if names != [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)]:
        raise CheckpointError(f"{path}: optimizer files {names}; DeepSpeed's ZeRO-1/2 MoE checkpoint of "
                              f"{dp} data-parallel ranks has zero_pp_rank_0..{dp - 1}_mp_rank_00_optim_states.pt")
    if not isinstance(model_states.get("param_shapes"), (list, tuple)):
        raise CheckpointError(f"{path}: its model file's param_shapes is not a list of per-group {{name: shape}}; "
                              "cannot map DeepSpeed's ZeRO-1/2 MoE flats")
    experts = _experts(path, model_states)
    groups = [list(g.items()) for g in model_states["param_shapes"]]
    use_data_before = bool((states[0].get("ds_config") or {}).get("use_data_before_expert_parallelism", False))
    out = []
    for rank, (source, state) in enumerate(zip(names, states)):
        osd = state["optimizer_state_dict"]
        if osd.get("dynamic_loss_scale"):
            raise CheckpointError(f"{source}: a dynamic loss scale (fp16) is not read from DeepSpeed's ZeRO-1/2 AutoEP "
                                  "files here")
        flats, base = osd[FLATS], osd[BASE]
        counts = osd.get("partition_count")
        if len(flats) != len(groups) or len(base["param_groups"]) != len(groups) or len(counts) != len(groups):
            raise CheckpointError(f"{source}: {len(flats)} flat partitions and {len(base['param_groups'])} param "
                                  f"groups for the {len(groups)} groups of the model file's param_shapes")
        pieces, shapes, steps = [], {}, set()
        for g, group in enumerate(groups):
            entries = [experts.get(n) for n, _ in group]
            if any(e is None for e in entries) != all(e is None for e in entries):
                raise CheckpointError(f"{source}: param group {g} mixes dense and expert parameters")
            n_parts, position, ep_rank = dp, rank, None
            if entries and entries[0] is not None:
                ep_size = {int(e["ep_size"]) for e in entries}
                if len(ep_size) != 1:
                    raise CheckpointError(f"{source}: expert group {g} holds layers of ep_size {sorted(ep_size)}")
                ep_size = ep_size.pop()
                if dp % ep_size:
                    raise CheckpointError(f"{source}: expert group {g} is of ep_size {ep_size}, which does not "
                                          f"divide the {dp} data-parallel ranks that saved it")
                ep_rank = next(e for e in range(ep_size)
                               if rank in autoep_zero12_dp_ranks(e, dp, ep_size, use_data_before))
                held = autoep_zero12_dp_ranks(ep_rank, dp, ep_size, use_data_before)
                n_parts, position = len(held), held.index(rank)
            if int(counts[g]) != n_parts:
                raise CheckpointError(f"{source}: param group {g} is partitioned over {counts[g]} ranks; DeepSpeed's "
                                      f"rule gives {n_parts}")
            layout = Description.of([group], n_parts, zero3=False)
            if flats[g].numel() != layout.partitions[0].shard_numel:
                raise CheckpointError(f"{source}: flat partition {g} holds {flats[g].numel()} elements; DeepSpeed's "
                                      f"ZeRO-1/2 rule gives {layout.partitions[0].shard_numel} ({layout.summary()})")
            index = base["param_groups"][g]["params"]
            state_g = base["state"].get(index[0], {}) if len(index) == 1 else None
            if state_g is None:
                raise CheckpointError(f"{source}: param group {g} lists {index}, not one flat")
            fields = {"fp32": flats[g].reshape(-1)}
            for field, value in state_g.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != flats[g].numel():
                        raise CheckpointError(f"{source}: {field} of group {g} has {value.numel()} elements, its "
                                              f"flat {flats[g].numel()}")
                    fields[field] = value.reshape(-1)
                elif field == "step":
                    steps.add(float(value))
            for f in layout.fragments(position):
                name, start, shape = f.name, f.param_offset, f.shape
                if ep_rank is not None:
                    name, start, shape = _global(source, experts[f.name], ep_rank, f.name, start, shape)
                shapes[name] = shape
                pieces.append((name, start, f.numel, {k: v.narrow(0, f.flat_offset, f.numel)
                                                      for k, v in fields.items()}))
        if len(steps) > 1:
            raise CheckpointError(f"{source}: its param groups record different steps {sorted(steps)}")
        out.append({"ds_moe_pieces": pieces, "shapes": shapes, "step": steps.pop() if steps else None,
                    "param_groups": _folded(source, base["param_groups"], count),
                    "loss_scaler": None})
    return out
