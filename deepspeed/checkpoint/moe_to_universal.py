"""`ds_to_universal` of checkpoints in the MoE layout (AutoEP, `deepspeed.moe` with any ep_size).

Such a tag ([Note: MoE checkpoint layout] in runtime/checkpoint/moe_io.py) keeps the module without
experts in `mp_rank_00_model_states.pt`, one `layer_{L}_expert_{E}_...` file per global expert, and the
optimizer as named pieces (`ds_moe_pieces`: global name, offset into the whole tensor, fp32 master and
every optimizer field) in each rank's `expp_rank_*` (no ZeRO) or `zero_pp_rank_*` (ZeRO) file. The
pieces name what they are, so the whole tensors are joined from all files whatever ep_size, data size
and ZeRO stage wrote them, and written in upstream's universal layout: `zero/<name>/<field>.pt` with
`{"param": whole tensor}`. An AutoEP expert tensor (the fused HF `[num_experts, ...]` tensor under the
layer's `expert_key_prefix` of `ds_autoep_layers`) also carries upstream's markers: `cat_dim` 0,
`is_expert_param` and `ep_num_experts`, from which any ep_size cuts its rows. `deepspeed.moe` experts
are one parameter per global expert (`...deepspeed_experts.{E}...`), each written whole under that name.
The model-states and per-expert files are copied (both are independent of ep_size). With tensor
parallelism (EP x TP: one `mp_rank_XX` file set per tensor rank) the sets are joined too (`join_moe`).
For AutoEP the files are DeepSpeed 0.19.8's form (`common_state`), which its load_universal reads.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from .constants import (AUTOEP_LAYERS_KEY, AUTOEP_ZERO3_SOURCE_GROUP, CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS,
                        EP_TP_LAYOUT_KEY, FOLDING_METADATA_KEY, PARAM)
from ..version import __version__
from .files import CheckpointError, expert_file, load_file, model_file, save_file
from .reader import CheckpointReader

PIECES = "ds_moe_pieces"   # runtime/checkpoint/moe_io.py writes them


def is_moe_layout(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "layer_*_expert_*_model_states.pt")))


def _optimizer_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "expp_rank_*_optim_states.pt")) +
                  glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt")))


def _expert_markers(states: dict) -> dict[str, dict]:
    """{expert_key_prefix: universal markers} of each AutoEP layer the model states describe."""
    out = {}
    for entry in states.get(AUTOEP_LAYERS_KEY) or []:
        out[entry["expert_key_prefix"]] = {CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                                           EP_NUM_EXPERTS: int(entry["num_experts"])}
    return out


def _markers(name: str, prefixes: dict[str, dict]) -> dict:
    owner = name.rpartition(".")[0]
    return prefixes.get(owner, {})


@dataclass
class MoEJoin:
    """A MoE-layout tag joined whole (`join_moe`): what its universal checkpoint holds."""
    states: dict                                # tensor rank 0's model states, its sliced entries whole
    whole: dict[str, dict[str, torch.Tensor]]   # field -> name -> flat whole tensor
    shapes: dict[str, tuple]                    # name -> whole shape
    steps: set
    param_groups: list[dict]
    loss_scaler: Any
    cat_dims: dict[str, int]                    # tensor-sliced (unfused) parameters: the dim joined on
    expert_files: dict[str, str]                # universal expert file name -> the saved file it copies


def megatron_dims(where: str, states: dict) -> dict[str, int]:
    """{name: partition dim} of the Megatron-style tensor layers the model states tag; a tag without a
    usable dim is refused (its slices cannot be joined)."""
    from ..runtime.checkpoint.writer import MEGATRON_TP_DIMS

    tagged = states.get(MEGATRON_TP_DIMS) or {}
    undescribed = sorted(n for n, d in tagged.items() if d is None)
    if undescribed:
        raise CheckpointError(f"{where}: tensor-parallel parameters {undescribed} carry no partition_dim "
                              "(or a partition_stride other than 1); cannot join their slices")
    return dict(tagged)


def _tensor_dims(where: str, models: dict[int, dict]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The tensor-sliced parameters of an EP x TP tag, from its model states: AutoTP's `tp_partition_dims`
    (fused `tp_sub_param_sizes`) and the `partition_dim` of Megatron-style layers."""
    dims, blocks = {}, {}
    for states in models.values():
        if (states.get(EP_TP_LAYOUT_KEY) or {}).get("expert_tensor_parallel"):
            raise CheckpointError(f"{where}: its experts are sliced over the tensor ranks (MoE "
                                  "enable_expert_tensor_parallelism); ds_to_universal does not join them")
        dims.update(megatron_dims(where, states))
        dims.update(states.get("tp_partition_dims") or {})
        blocks.update(states.get("tp_sub_param_sizes") or {})
    return dims, blocks


def join_moe(input_folder: str) -> MoEJoin:
    """Every trained parameter of the MoE-layout tag `input_folder` whole, with each optimizer field
    ([Note: EP x TP checkpoint layout] in runtime/checkpoint/ep_tp_io.py for the tensor file sets): the
    named pieces of each tensor rank's optimizer files joined; a tensor-sliced parameter's slices then
    joined along its partition dim in tensor-rank order; everything else (replicated layers, experts,
    which a folded layout spreads over the tensor ranks) filled from whichever set holds it, tensor rank
    0's first."""
    sets = sorted(int(m.group(1)) for m in map(re.compile(r"mp_rank_(\d+)_model_states\.pt$").match,
                                               os.listdir(input_folder)) if m)
    if sets != list(range(len(sets))):
        raise CheckpointError(f"{input_folder}: model-states files of tensor ranks {sets}; expected "
                              f"{model_file()} .. mp_rank_<tp-1> (one per tensor rank)")
    models = {t: load_file(os.path.join(input_folder, model_file(t))) for t in sets}
    dims, blocks = _tensor_dims(input_folder, models) if len(sets) > 1 else ({}, {})
    found = _optimizer_files(input_folder)
    if not found:
        raise CheckpointError(f"{input_folder}: an MoE checkpoint without optimizer files has nothing to convert "
                              "(its per-expert files load at any ep_size as they are)")
    loaded = [load_file(f) for f in found]
    loaded = [s.get("optimizer_state_dict", s) for s in loaded]
    foreign = [os.path.basename(f) for f, s in zip(found, loaded) if PIECES not in s]
    if foreign:
        raise CheckpointError(f"{input_folder}: {foreign} hold no named pieces ({PIECES}): an MoE checkpoint "
                              "written by DeepSpeed itself; convert it with DeepSpeed's ds_to_universal")
    tensor_rank = [int(m.group(1)) if m else 0 for m in (re.search(r"_mp_rank_(\d+)_", os.path.basename(f))
                                                          for f in found)]
    values: dict[str, dict[tuple, torch.Tensor]] = {}   # field -> (tensor rank or None, name) -> flat
    covered: dict[tuple, torch.Tensor] = {}
    shapes: dict[tuple, tuple] = {}
    # tensor rank 0's files last: where sets overlap (replicated parameters), its values are the ones kept
    for t, state in sorted(zip(tensor_rank, loaded), key=lambda pair: -pair[0]):
        for name, start, numel, pieces in state[PIECES]:
            key = (t if name in dims else None, name)
            shape = tuple(state["shapes"][name])
            if shapes.setdefault(key, shape) != shape:
                raise CheckpointError(f"{input_folder}: {name!r} has shape {shape} on tensor rank {t} and "
                                      f"{shapes[key]} on another, but no tensor-parallel dim is recorded for it")
            size = torch.Size(shape).numel()
            covered.setdefault(key, torch.zeros(size, dtype=torch.bool))[start:start + numel] = True  # host: offline
            for field, value in pieces.items():
                flat = values.setdefault(field, {}).setdefault(
                    key, torch.zeros(size, dtype=torch.float32))   # host: offline conversion
                flat[start:start + numel].copy_(value.reshape(-1))
    for (t, name), mask in covered.items():
        if not bool(mask.all()):
            where = "" if t is None else f" (tensor rank {t})"
            raise CheckpointError(f"{input_folder}: parameter {name!r}{where} is incomplete in the optimizer files "
                                  f"({int(mask.sum())} of {mask.numel()} elements): a rank's file is missing")
    whole, whole_shapes = _join_tensor_slices(input_folder, values, shapes, dims, blocks, sets)
    steps = {s["step"] for s in loaded if s.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointError(f"{input_folder}: the optimizer files record different steps {sorted(steps)}")
    first = loaded[tensor_rank.index(0)] if 0 in tensor_rank else loaded[0]
    cat_dims = {n: d for n, d in dims.items() if n in whole_shapes and not blocks.get(n)}
    return MoEJoin(_whole_model_states(models, dims, blocks), whole, whole_shapes, steps, first["param_groups"],
                   first.get("loss_scaler"), cat_dims, _expert_files(input_folder))


def _join_tensor_slices(where: str, values: dict, shapes: dict, dims: dict, blocks: dict,
                        sets: list[int]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, tuple]]:
    """{field: {name: flat whole}} and the whole shapes: each tensor-sliced parameter's per-rank slices
    joined along its dim (fused weights block by block), the others as they are."""
    from ..utils.zero_to_fp32 import join_tp_slices

    whole: dict[str, dict[str, torch.Tensor]] = {}
    out_shapes = {name: shape for (t, name), shape in shapes.items() if t is None}
    for field, by_key in values.items():
        target = whole.setdefault(field, {})
        for (t, name), flat in by_key.items():
            if t is None:
                target[name] = flat
        for name in sorted({n for t, n in by_key if t is not None}):
            missing = [t for t in sets if (t, name) not in by_key]
            if missing:
                raise CheckpointError(f"{where}: parameter {name!r} ({field}) is missing from the files of tensor "
                                      f"ranks {missing}")
            joined = join_tp_slices([by_key[(t, name)].view(shapes[(t, name)]) for t in sets], dims[name],
                                    blocks.get(name))
            target[name], out_shapes[name] = joined.reshape(-1), tuple(joined.shape)
    return whole, out_shapes


def _whole_model_states(models: dict[int, dict], dims: dict, blocks: dict) -> dict:
    """Tensor rank 0's model states as one tensor set: sliced module entries whole, `mp_world_size` 1, and
    without the records of the saved tensor layout (a universal checkpoint has no tensor ranks)."""
    from ..utils.zero_to_fp32 import join_tp_slices

    states = {k: v for k, v in models[0].items() if k not in (EP_TP_LAYOUT_KEY, FOLDING_METADATA_KEY)}
    if len(models) == 1:
        return states
    module = dict(states.get("module") or {})
    for name in module:
        if name in dims:
            module[name] = join_tp_slices([models[t]["module"][name] for t in sorted(models)], dims[name],
                                          blocks.get(name))
    return dict(states, module=module, mp_world_size=1)


def _expert_files(input_folder: str) -> dict[str, str]:
    """{`layer_L_expert_E_mp_rank_00_...`: the saved file}: one per expert, from the lowest tensor rank
    holding it (with an mpu each tensor rank holds a copy; folded AutoEP, one of them)."""
    out = {}
    for source in sorted(glob.glob(os.path.join(input_folder, "layer_*_expert_*_model_states.pt")), reverse=True):
        match = re.match(r"layer_(\d+)_expert_(\d+)_mp_rank_\d+_model_states\.pt$", os.path.basename(source))
        if match:
            out[expert_file(int(match.group(1)), int(match.group(2)))] = source
    return out


class JoinedReader(CheckpointReader):
    """A MoE-layout tag read as its universal form would be (`join_moe`'s whole values, in memory): how
    load_checkpoint reads an EP x TP checkpoint at another tensor or expert-parallel size, each rank then
    cutting its slices as from a universal checkpoint (runtime/checkpoint/tp_reslice.universal_cut_reader)."""

    def __init__(self, path: str, tag: str) -> None:   # (not CheckpointReader's: nothing is read lazily)
        joined = join_moe(path)
        self.path, self.tag, self.mp_rank, self.universal = path, tag, 0, True
        self.rank_files, self.zero_states, self.optimizer_state, self.mappings = [], [], [], []
        self._partitions, self._parts, self._read_ranks, self._stage_value = [], {}, set(), 0
        self.model_states = universal_states(joined.states, joined.whole["fp32"], joined.shapes)
        self._full = {field: {n: v.view(joined.shapes[n]) for n, v in values.items()}
                      for field, values in joined.whole.items()}
        self._set_groups([{n: torch.Size(joined.shapes[n]) for n in sorted(joined.whole["fp32"])}])
        self.common_state = common_state(joined.param_groups, joined.loss_scaler, joined.states)
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.common_state["param_groups"]]
        self._step = float(next(iter(joined.steps))) if joined.steps else None


def convert_moe(input_folder: str, output_folder: str) -> int:
    """Write the universal checkpoint of the MoE-layout tag `input_folder`; returns the parameter count."""
    joined = join_moe(input_folder)
    write_universal(output_folder, joined.states, joined.whole, joined.shapes, joined.steps, joined.param_groups,
                    joined.loss_scaler, cat_dims=joined.cat_dims)
    for name, source in joined.expert_files.items():
        shutil.copyfile(source, os.path.join(output_folder, name))
    return len(joined.shapes)


def write_universal(output_folder: str, states: dict, whole: dict[str, dict[str, torch.Tensor]], shapes: dict,
                    steps: set, param_groups: list[dict], loss_scaler: Any, raw_dense: bool = False,
                    cat_dims: dict[str, int] | None = None, common: dict | None = None) -> None:
    """Upstream's universal layout from whole values ({field: {name: flat tensor}}): `zero/<name>/<field>.pt`
    (AutoEP expert tensors with their markers, tensor-sliced ones with the `cat_dim` of `cat_dims` they were
    joined on, as upstream's converter writes it; with `raw_dense` the other parameters as bare tensors, as
    upstream writes a ZeRO-3 tag's), `step.pt`, `zero/optimizer_state.pt` (with `common`'s entries), and the
    model states `states` with every trained parameter, experts whole, in `param_shapes`."""
    prefixes = _expert_markers(states)
    zero_dir = os.path.join(output_folder, "zero")
    for name in sorted(whole["fp32"]):
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        extra = _markers(name, prefixes) or ({} if raw_dense else {CAT_DIM: (cat_dims or {}).get(name, 0)})
        for field, values in whole.items():
            if name in values:
                value = values[name].view(shapes[name])
                save_file(value if raw_dense and not extra else {PARAM: value, **extra},
                          os.path.join(folder, f"{field}.pt"))
        if steps:
            save_file(torch.tensor(float(next(iter(steps)))), os.path.join(folder, "step.pt"))  # host: a file
    save_file({**(common or {}), **common_state(param_groups, loss_scaler, states)},
              os.path.join(zero_dir, "optimizer_state.pt"))
    save_file(universal_states(states, whole["fp32"], shapes), os.path.join(output_folder, model_file()))


def common_state(param_groups: list[dict], loss_scaler: Any, states: dict) -> dict:
    """`zero/optimizer_state.pt`: the param groups (one index each), the loss scaler and `ds_version` (upstream's
    load_universal asserts it). Upstream's AutoEP engine splits each optimizer group into its dense parameters
    and, appended after all of them, one group per expert group (`split_params_into_different_moe_groups_for_
    optimizer`: `name` "ep_size_<ep>", `moe` True), and its load_universal pairs the saved groups with its own by
    position (zip: a missing group is silently not loaded), so an AutoEP checkpoint's groups are written in that
    form; our loader folds them back (moe_io.source_param_groups)."""
    groups = [dict(g) for g in param_groups]
    sizes = sorted({int(entry["ep_size"]) for entry in states.get(AUTOEP_LAYERS_KEY) or []})
    if sizes and not any(g.get("moe") for g in groups):
        dense = [dict(g, name=g.get("name", "dense-params")) for g in groups]
        groups = dense + [dict(g, name=f"ep_size_{ep}", moe=True) for g in dense for ep in sizes]
    common = {"param_groups": [dict(g, params=[i]) for i, g in enumerate(groups)],
              "ds_version": states.get("ds_version") or __version__}
    if loss_scaler is not None:   # upstream unpickles its scaler class there (the pieces keep a state dict)
        common["loss_scaler"], common["dynamic_loss_scale"] = _scaler_object(loss_scaler)
    return common


def _scaler_object(saved: Any) -> tuple[Any, bool]:
    """(the loss scaler as the object DeepSpeed's ZeRO files pickle, whether it is dynamic) from the state
    dict an MoE checkpoint's pieces keep (or that object itself)."""
    from ..runtime.checkpoint.hp_state import upstream_scaler
    from ..runtime.precision.loss_scaler import scaler_from_state_dict

    if not isinstance(saved, dict):
        return saved, bool(getattr(saved, "dynamic", False))
    scaler = scaler_from_state_dict(saved)
    return upstream_scaler(scaler), scaler.dynamic


def universal_states(states: dict, trained: dict, shapes: dict) -> dict:
    """The model states with `param_shapes` naming every trained parameter (the universal reader's list)
    at its whole shape: the experts too."""
    listed = [{n: torch.Size(shapes[n]) if n in shapes else s for n, s in g.items()}
              for g in (states.get("param_shapes") or [{}])] or [{}]
    known = {n for g in listed for n in g}
    listed[-1].update({n: torch.Size(shapes[n]) for n in sorted(trained) if n not in known})
    return dict(states, param_shapes=listed)


def is_autoep_zero3_layout(path: str) -> bool:
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 layout ([Note: AutoEP ZeRO-3 layout]): rank 0's model states say so."""
    from ..utils.zero_to_fp32 import is_autoep_zero3_partitioned

    first = os.path.join(path, model_file(0, zero3_dp_rank=0))
    return os.path.isfile(first) and is_autoep_zero3_partitioned(load_file(first))


def convert_autoep_zero3(input_folder: str, output_folder: str) -> int:
    """The universal checkpoint of an AutoEP ZeRO-3 tag: every rank's per-parameter pieces joined into whole
    tensors (`join_autoep_zero3`, which zero_to_fp32 uses), experts [num_experts, ...] with their markers."""
    from ..utils.zero_to_fp32 import join_autoep_zero3

    ranks = {int(m.group(1)): os.path.join(input_folder, f) for f in os.listdir(input_folder)
             for m in [re.search(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$", f)] if m}
    if sorted(ranks) != list(range(len(ranks))) or not ranks:
        raise CheckpointError(f"{input_folder}: AutoEP ZeRO-3 optimizer files of ranks {sorted(ranks)}; expected "
                              "ranks 0..N-1 (they hold every trained weight)")
    models = [load_file(os.path.join(input_folder, model_file(0, zero3_dp_rank=r))) for r in range(len(ranks))]
    optim = [load_file(ranks[r])["optimizer_state_dict"] for r in range(len(ranks))]
    values, shapes = join_autoep_zero3(models, optim, input_folder)
    whole = {f: {n: v.contiguous().reshape(-1) for n, v in by_name.items()} for f, by_name in values.items()}
    base = optim[0]["optimizer_state_dict"]
    steps = {float(entry["step"]) for entry in base["state"].values() if "step" in entry}
    states = dict(models[0], param_shapes=[{n: torch.Size(shapes[n]) for n in g} for g in models[0]["param_shapes"]])
    # upstream's ZeRO-3 load_universal reads the step and hyperparameters from rank 0's optimizer state, kept
    # here as its converter keeps it (without the flat partitions)
    inner = {"state": {i: {"step": e["step"]} for i, e in base["state"].items() if "step" in e},
             "param_groups": base["param_groups"]}
    kept = {k: v for k, v in optim[0].items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
    write_universal(output_folder, states, whole, shapes, steps, source_groups(base["param_groups"]),
                    optim[0].get("loss_scaler"), raw_dense=True, common={**kept, "optimizer_state_dict": inner})
    for r in range(len(ranks)):   # as upstream's converter: its ZeRO-3 load_universal reads these
        shutil.copyfile(os.path.join(input_folder, model_file(0, zero3_dp_rank=r)),
                        os.path.join(output_folder, model_file(0, zero3_dp_rank=r)))
    return len(shapes)


def source_groups(saved: list[dict]) -> list[dict]:
    """The hyperparameters of each optimizer group of the engine that saved an AutoEP ZeRO-3 tag: the first
    sub-group each became (ours record which; in upstream's files each sub-group stands for itself)."""
    firsts: dict[int, dict] = {}
    for i, group in enumerate(saved):
        firsts.setdefault(int(group.get(AUTOEP_ZERO3_SOURCE_GROUP, i)), group)
    ours = any(AUTOEP_ZERO3_SOURCE_GROUP in group for group in saved)   # upstream's: its split groups, kept
    drop = {"params", AUTOEP_ZERO3_SOURCE_GROUP} | ({"name", "moe"} if ours else set())
    return [{k: v for k, v in firsts[g].items() if k not in drop} for g in sorted(firsts)]
