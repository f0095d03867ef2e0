"""AutoEP at ZeRO-3 (autoep_size > 1) in DeepSpeed 0.19.8's partition-native checkpoint layout.

[Note: AutoEP ZeRO-3 layout]
Upstream keeps ZeRO-3 AutoEP experts inside its ZeRO-3 files: there are no expert files. Every rank r
writes `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (the module without the experts, `param_shapes`
per sub-group, `ds_autoep_layers` entries marked `checkpoint_format: zero3_partitioned`) and
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt`, whose sub-groups are, in upstream's order (its
`split_params_into_different_moe_groups_for_optimizer`): each optimizer group's dense parameters,
partitioned per parameter over the data-parallel ranks, then each group's expert parameters (this EP
rank's local rows, shape [num_local_experts, ...]) partitioned per parameter over the expert's replica
(expert-data-parallel) group; `ds_zero_partition_groups` says which group and rank each sub-group
is cut for. Our ZeRO-3 units hold exactly these pieces (expert units live on their EDP group:
[Note: ZeRO-3 expert units]), so saving moves no element between ranks. Loading joins every rank's
pieces into whole tensors (`join_autoep_zero3` in utils/zero_to_fp32.py, which zero_to_fp32 uses
too) and keeps this rank's rows, so any ep size, world size or stage reads it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ... import comm as ds_comm
from ...checkpoint.constants import (AUTOEP_LAYERS_KEY, AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY as FORMAT_KEY,
                                     AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION as VERSION,
                                     AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY as VERSION_KEY,
                                     AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT as FORMAT,
                                     AUTOEP_ZERO3_SOURCE_GROUP as SOURCE_GROUP, UNIVERSAL_CHECKPOINT_INFO,
                                     UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
from ...checkpoint.files import CheckpointError, load_file, model_file, optim_file, tag_dir
from ...checkpoint.moe_to_universal import is_autoep_zero3_layout as is_partitioned_checkpoint, source_groups
from ...checkpoint.reader import CheckpointReader
from ...moe.utils import is_moe_param
from ...module_inject.auto_ep_layer import local_expert_state
from ...utils.zero_to_fp32 import ZERO_PARTITION_GROUPS, join_autoep_zero3
from ..zero.partition import ParamwisePartition
from .autoep_io import autoep_params, layer_metadata
from .hp_state import HpState
from .view import CheckpointView
from .zero3_io import stage3_header


def uses_layout(view: CheckpointView) -> bool:
    """ZeRO-3 with AutoEP experts on their expert-data-parallel units and no other expert parameters
    (`deepspeed.moe.layer.MoE` at stage 3 keeps the MoE layout: upstream refuses that layer there)."""
    from .moe_io import is_moe_engine

    if view.stage3 is None or not is_moe_engine(view):
        return False
    autoep = autoep_params(view)
    return bool(autoep) and all(n in autoep for n, p in view.module.named_parameters() if is_moe_param(p))


@dataclass
class FileGroup:
    """One sub-group of the files: parameters (name, local shape) of optimizer group `source`, partitioned
    per parameter over `world` ranks (this rank is `rank`; `ranks`: their global ranks)."""
    source: int
    expert_group: str | None   # the EP group name of expert sub-groups, None for dense ones
    params: list[tuple[str, torch.Size]]
    world: int
    rank: int
    ranks: list[int]


def file_groups(view: CheckpointView, hp: HpState) -> list[FileGroup]:
    """Upstream's sub-groups from our optimizer groups: each group's dense part, then each group's experts
    (per EP group name); each partitioned as the unit holding its parameters is."""
    autoep = autoep_params(view)
    unit_of = {n: u for u in view.stage3.units for n in u.spec.param_names}
    dense, experts = [], []
    for g, group in enumerate(hp.groups):
        own = [(n, s) for n, s in group if n not in autoep]
        if own:
            dense.append((g, None, own))
        by_name: dict[str, list] = {}
        for n, s in group:
            if n in autoep:
                by_name.setdefault(autoep[n][1].expert_group_name, []).append((n, s))
        experts += [(g, name, params) for name, params in by_name.items()]
    out = []
    for g, name, params in dense + experts:
        units = {id(unit_of[n]): unit_of[n] for n, _ in params}
        worlds = {(u.world, u.rank) for u in units.values()}
        if len(worlds) != 1:   # (every dense unit is on the data-parallel group, every expert one on its EDP group)
            raise CheckpointError(f"save_checkpoint: the parameters of optimizer group {g} "
                                  f"({'experts ' + name if name else 'dense'}) are partitioned over different "
                                  f"group sizes {sorted(worlds)}; upstream's AutoEP ZeRO-3 layout needs one")
        unit = next(iter(units.values()))
        out.append(FileGroup(g, name, params, unit.world, unit.rank, ds_comm.get_all_ranks_from_group(unit.group)))
    return out


def _flats(hp: HpState, groups: list[FileGroup], fields: list[str]) -> dict[str, list[torch.Tensor]]:
    """This rank's per-parameter partition of each file group, for the fp32 masters and each field: the
    pieces it holds, placed where the layout puts them (local: the units hold exactly these pieces)."""
    where = {n: (g, i) for g, fg in enumerate(groups) for i, (n, _) in enumerate(fg.params)}
    layouts = [ParamwisePartition(tuple(torch.Size(s).numel() for _, s in fg.params), fg.world) for fg in groups]
    flats = {f: [torch.zeros(layout.shard_numel, dtype=torch.float32) for layout in layouts]  # host: checkpoint file
             for f in ["fp32"] + fields}
    for piece in hp.pieces:
        g, i = where[piece.name]
        for dst, at, n, src in layouts[g].placements(i, piece.start, piece.numel):
            if dst != groups[g].rank:
                raise CheckpointError(f"save_checkpoint: {piece.name}[{piece.start + src}:] lies on partition rank "
                                      f"{dst} of its group, this rank is {groups[g].rank} (unit layout changed?)")
            for field in flats:
                value = hp.value(piece, field)
                if value is not None:
                    flats[field][g][at:at + n].copy_(value[src:src + n].float())
    return flats


def optimizer_state(view: CheckpointView, hp: HpState, groups: list[FileGroup],
                    fields_step: tuple | None = None) -> dict:
    """This rank's `optimizer_state_dict` in upstream's layout (local: no collective); `fields_step`: the
    optimizer fields and step of every rank (HpState.agreed_fields), else this rank's own."""
    fields, step = fields_step if fields_step is not None else hp.local_fields()
    flats = _flats(hp, groups, fields)
    state, param_groups = {}, []
    for g, fg in enumerate(groups):
        entry: dict[str, Any] = {} if step is None else {"step": torch.tensor(float(step))}  # host: checkpoint file
        entry.update({field: flats[field][g] for field in fields})
        state[g] = entry
        group = {k: v for k, v in hp.base.param_groups[fg.source].items() if k != "params"}
        if fg.expert_group:   # upstream's names for the groups its split makes
            group.update(name=fg.expert_group, moe=True)
        else:
            group.setdefault("name", "dense-params")
        param_groups.append({**group, SOURCE_GROUP: fg.source, "params": [g]})
    return {
        **stage3_header(hp, view.dp_world_size),
        ZERO_PARTITION_GROUPS: [{"sub_group": g, "partition_count": fg.world, "partition_rank": fg.rank,
                                 "partition_ranks": fg.ranks,
                                 "families": ["autoep_expert" if fg.expert_group else "replicated"],
                                 "group_names": [fg.expert_group or "replicated"]} for g, fg in enumerate(groups)],
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": flats["fp32"],
    }


def layers_record(view: CheckpointView) -> list[dict]:
    """`ds_autoep_layers` as upstream writes it at ZeRO-3: each layer's split, this rank's EP and EDP
    place, and the partition-native format marker."""
    from ...utils import groups

    layers = {layer_id: layer for layer_id, layer in autoep_params(view).values()}
    out = []
    for entry in layer_metadata(view):
        layer = layers[entry["moe_layer_id"]]
        name = layer.expert_group_name
        ep_rank, local = groups._get_expert_parallel_rank(name), entry["num_local_experts"]
        out.append({**entry,
                    "expert_placement": {"version": 1, "num_experts": entry["num_experts"], "ep_size": entry["ep_size"],
                                         "ranks": [{"rank": e, "experts": list(range(e * local, (e + 1) * local))}
                                                   for e in range(entry["ep_size"])]},
                    FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, "ep_group_name": name, "ep_rank": ep_rank,
                    "expert_data_parallel_rank": groups._get_expert_data_parallel_rank(name),
                    "expert_data_parallel_world_size": groups._get_expert_data_parallel_world_size(name),
                    "global_expert_start": ep_rank * local, "global_expert_end": (ep_rank + 1) * local})
    return out


def save_entries(view: CheckpointView, hp: HpState | None, client_state: dict, exclude_frozen: bool,
                 snapshot: bool, frozen: Any, fields_step: tuple | None = None) -> list:
    """This rank's two files ([Note: AutoEP ZeRO-3 layout]), as (name, object); `frozen`: this rank's pieces
    of the frozen parameters (zero3_io.frozen_fragments); `fields_step`: see optimizer_state."""
    from ...version import __version__
    from .writer import model_states

    autoep = autoep_params(view)
    frozen_experts = [n for n, p in view.module.named_parameters() if n in autoep and not p.requires_grad]
    if frozen_experts:   # (upstream refuses them too: frozen pieces are not in the optimizer files)
        raise CheckpointError(f"save_checkpoint: frozen AutoEP expert parameters {frozen_experts} at ZeRO-3 are not "
                              "supported by upstream's partition-native layout")
    groups = file_groups(view, hp) if hp is not None else []
    with local_expert_state():   # no whole-expert gather: the experts are not in this file
        state = model_states(view, hp, client_state, exclude_frozen, True, zero3_frozen=frozen or OrderedDict(),
                             snapshot=snapshot)
    state["module"] = OrderedDict((k, v) for k, v in state["module"].items() if k not in autoep)
    if hp is not None:
        state["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in fg.params) for fg in groups]
    record = layers_record(view)
    state["num_experts"] = list(view.num_experts)
    state[AUTOEP_LAYERS_KEY] = record
    state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                                        "expert_parameter_patterns": [r".*\.experts\.w[123]$"],
                                        AUTOEP_LAYERS_KEY: record}
    dp = view.dp_rank
    entries: list = [(model_file(0, zero3_dp_rank=dp), state)]
    if hp is not None:
        entries.append((optim_file(dp, bf16=view.bf16, mp_rank=0),
                        {"optimizer_state_dict": optimizer_state(view, hp, groups, fields_step),
                         "ds_config": view.ds_config, "ds_version": __version__}))
    return entries


class AutoEPZero3Reader(CheckpointReader):
    """A checkpoint in upstream's AutoEP ZeRO-3 layout as this rank's model sees it: each parameter whole (the
    ranks' partitions joined), an AutoEP expert tensor as this rank's rows (any ep size). Lazy: the files are
    memory-mapped and `read` copies only the slice asked for out of the partitions that hold it."""

    def __init__(self, view: CheckpointView, load_dir: str, tag: str) -> None:
        path = tag_dir(load_dir, tag)
        if path is None:
            raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (no directory {tag})")
        self.path, self.tag, self.mp_rank, self.universal, self.stage = path, tag, 0, False, 3
        self.model_states = load_file(os.path.join(path, model_file(0, zero3_dp_rank=0)))
        self.rank_files = self._optim_files()
        if not self.rank_files:
            raise CheckpointError(f"{path}: an AutoEP ZeRO-3 checkpoint ({AUTOEP_LAYERS_KEY} marked {FORMAT}) "
                                  "without its zero_pp_rank_*_optim_states.pt files: they hold every trained weight")
        self._check_rank_count(load_file(self.rank_files[0]))
        self.zero_states = [load_file(f) for f in self.rank_files]
        self.optimizer_state = [s["optimizer_state_dict"] for s in self.zero_states]
        models = [self.model_states] + [load_file(os.path.join(path, model_file(0, zero3_dp_rank=r)))
                                        for r in range(1, len(self.rank_files))]
        self._lazy, shapes = join_autoep_zero3(models, self.optimizer_state, path)
        autoep = autoep_params(view)
        self._first_row: dict[str, int] = {}   # an AutoEP tensor: where this rank's rows start in the whole
        for name in autoep:
            if name in shapes:
                layer = autoep[name][1]
                rows = (layer.num_local_experts,) + tuple(shapes[name][1:])
                self._first_row[name] = layer.first_expert * torch.Size(rows[1:]).numel()
                shapes[name] = rows
        self._set_groups([shapes])
        self._full, self._fragment_cache, self._parts = {}, {}, {}
        self.common_state = self.optimizer_state[0]
        base = self.optimizer_state[0]["optimizer_state_dict"]
        self._step = self._find_step([base["state"][k] for k in sorted(base["state"])], {})
        groups = source_groups(base["param_groups"])   # (upstream's split groups: this engine's own kept)
        self.param_groups = groups if view.has_optimizer and len(groups) == len(view.optimizer.param_groups) \
            else []

    def fields(self) -> list[str]:
        return sorted(f for f in self._lazy if f != "fp32")

    def has_field(self, name: str, field: str) -> bool:
        return self._lazy.get(field, {}).get(name) is not None

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no parameter named {name!r} in the checkpoint")
        g, i = self._where[name]
        numel = self._groups[g][i][1].numel() - start if numel is None else numel
        lazy = self._lazy.get(field, {}).get(name)
        if lazy is None:
            return None
        return lazy.flat_slice(self._first_row.get(name, 0) + start, numel, torch.float32)
