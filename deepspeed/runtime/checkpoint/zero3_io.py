"""ZeRO-3 specifics of checkpoints: DeepSpeed's stage-3 files from our gather units, and back.

Our ZeRO-3 units shard each parameter on its own (stage3/unit_layout.py): rank r holds elements
[r*s, (r+1)*s) of every parameter (s = ceil(numel/N), zero-padded) -- upstream's `ds_tensor`,
and exactly the pieces DeepSpeed's stage-3 files hold. The files concatenate those pieces in
param-group order (`ParamwisePartition` per group) where a unit concatenates them in unit
order, so trained state (fp32 masters, optimizer fields) is re-cut into the files' order by
HpState.recut_fields without moving an element between ranks (it issues no collective then). Frozen
parameters have no master: their per-rank pieces (`frozen_param_fragments` of each rank's
model-states file) are the parameters' `ds_tensor`s. Loading writes values into this rank's
pieces of each unit (and of its fp32 master, which the next step copies back into the shard)
and re-gathers persistent units.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ...checkpoint.description import FRAGMENTS_KEY, Description
from .hp_state import HpState, upstream_scaler
from .view import CheckpointView


def param_shapes(view: CheckpointView) -> dict[str, torch.Size]:
    """Full shape of every parameter by (first) name; ZeRO-3 parameters are released placeholders."""
    return {n: s for u in view.stage3.units for n, s in zip(u.spec.param_names, u.shapes)}


def frozen_fragments(view: CheckpointView, rank: int, world: int) -> OrderedDict:
    """{frozen parameter name: this rank's paramwise piece}, in module order: the pieces the
    units hold (no communication) when they are sharded over the `world` ranks the file is for,
    else cut from one gathered unit at a time (collective: every rank, in unit order)."""
    pieces: dict[str, torch.Tensor] = {}
    for unit in view.stage3.units:
        trained = set(unit.trainable)
        frozen = [i for i in range(len(unit.params)) if i not in trained]
        if not frozen:
            continue
        if unit.world == world and unit.rank == rank:
            for i in frozen:
                pieces[unit.spec.param_names[i]] = unit.layout.piece(unit.shard, i).to("cpu", copy=True)
            continue
        full = unit.gather_full(unit.shard)
        for i in frozen:
            value, size = full[i].reshape(-1), -(-unit.spec.numels[i] // world)
            piece = torch.zeros(size, dtype=value.dtype)  # host: checkpoint file
            mine = value[rank * size:(rank + 1) * size]
            piece[:mine.numel()].copy_(mine)
            pieces[unit.spec.param_names[i]] = piece
        del full
    order = [n for n, _ in view.module.named_parameters()]
    return OrderedDict((n, pieces[n]) for n in order if n in pieces)


def optimizer_state(view: CheckpointView, hp: HpState, rank: int, world: int, later: list | None = None,
                    fields_step: tuple | None = None, stream: bool = False) -> dict:
    """Rank `rank`'s `optimizer_state_dict` in DeepSpeed's ZeRO-3 layout (collective): per param
    group one fp32 flat (`fp32_flat_groups`, padding included) and its base optimizer state;
    `later`: see HpState.recut_fields; `fields_step`: HpState.agreed_fields(), when already known;
    `stream`: see writer.partitioned_optimizer_state."""
    described = Description.of(hp.groups, world, zero3=True)   # [Note: a checkpoint describes itself]
    layouts = described.partitions
    fields, step = fields_step if fields_step is not None else hp.agreed_fields(view.dp_group)
    parts = hp.recut(["fp32"] + fields, layouts, rank, later=later, stream=stream)
    base_state = {}
    for g in range(len(layouts)):
        entry: dict[str, Any] = {} if step is None else {"step": torch.tensor(float(step))}  # host: checkpoint file
        entry.update({field: parts[field][g] for field in fields})
        base_state[g] = entry
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [g]}
                    for g, group in enumerate(hp.base.param_groups)]
    return {**stage3_header(hp, world), "optimizer_state_dict": {"state": base_state, "param_groups": param_groups},
            "fp32_flat_groups": parts["fp32"], FRAGMENTS_KEY: described.record(rank)}


def stage3_header(hp: HpState, world: int) -> dict:
    """The keys of DeepSpeed's ZeRO-3 `optimizer_state_dict` before the state itself."""
    from ..zero.config import ZeroStageEnum

    scaler = hp.wrapper.loss_scaler
    return {"zero_stage": ZeroStageEnum(3), "loss_scaler": upstream_scaler(scaler),
            "dynamic_loss_scale": bool(scaler.dynamic), "overflow": bool(getattr(hp.wrapper, "overflow", False)),
            "partition_count": world}


def write_param_slices(view: CheckpointView, values: dict[str, torch.Tensor]) -> None:
    """Write full values (by parameter name) into this rank's slice of their units, and of the
    units' fp32 masters when an optimizer trains them (local; the caller then re-gathers the
    persistent units with `engine._stage3.after_shard_update()`)."""
    masters = {id(um.unit): um.master for um in getattr(view.optimizer, "units", [])}
    with torch.no_grad():
        for unit in view.stage3.units:
            master = masters.get(id(unit))
            for f in unit.partition.fragments(unit.rank):
                value = values.get(unit.spec.param_names[f.index])
                if value is None:
                    continue
                piece = value.reshape(-1)[f.param_start:f.param_start + f.numel]
                unit.shard[f.shard_start:f.shard_start + f.numel].copy_(piece)
                if master is not None:
                    master[f.shard_start:f.shard_start + f.numel].copy_(piece)


def gathered_params(view: CheckpointView, wanted: Any, keep: Any = None, whole: Any = None) -> dict[int, torch.Tensor]:
    """{id(parameter): its full value, on the host} for each parameter `wanted(p)` (the same answer on
    every rank) that `keep(p)` (default: all) wants on this rank. Collective: every unit holding a
    wanted parameter is gathered once, in unit order, over its own group (an expert unit over its
    expert-data-parallel group: the value is this EP rank's expert), then `whole(p, value)` (collective
    too: a tensor- or expert-parallel slice made whole) runs on every rank; each gathered unit is dropped
    at once, so the extra memory is one unit plus what is kept."""
    out: dict[int, torch.Tensor] = {}
    for unit in view.stage3.units:  # unit order: the same collectives on every rank
        if not any(wanted(p) for p in unit.params):
            continue
        full = unit.gather_full(unit.shard)
        for i, p in enumerate(unit.params):
            if wanted(p):
                value = whole(p, full[i]) if whole is not None else full[i]
                if keep is None or keep(p):
                    out[id(p)] = value.detach().to("cpu", copy=True)
                del value   # nothing of this unit outlives it
        del full
    return out
