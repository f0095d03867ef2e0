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
The model-states and per-expert files are copied (both are independent of ep_size).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Any

import torch

from .constants import AUTOEP_LAYERS_KEY, AUTOEP_ZERO3_SOURCE_GROUP, CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM
from .files import CheckpointError, load_file, model_file, save_file

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


def convert_moe(input_folder: str, output_folder: str) -> int:
    """Write the universal checkpoint of the MoE-layout tag `input_folder`; returns the parameter count."""
    tensor_sets = sorted({m for f in os.listdir(input_folder)
                          for m in re.findall(r"_mp_rank_(\d+)_(?:model|optim)_states\.pt$", f)})
    if len(tensor_sets) > 1:   # EP x TP: each tensor rank's pieces are slices under the same names
        raise CheckpointError(f"{input_folder} is an expert-parallel checkpoint with tensor-parallel file sets "
                              f"(mp_rank_{', mp_rank_'.join(tensor_sets)}): ds_to_universal converts MoE / AutoEP "
                              "checkpoints without tensor parallelism only; load it with load_checkpoint at its "
                              "EP x TP layout or consolidate it with zero_to_fp32")
    states = load_file(os.path.join(input_folder, model_file()))
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
    whole: dict[str, dict[str, torch.Tensor]] = {}   # field -> name -> flat whole tensor
    covered: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple] = {}
    for state in loaded:
        shapes.update({n: tuple(s) for n, s in state["shapes"].items()})
        for name, start, numel, values in state[PIECES]:
            size = torch.Size(shapes[name]).numel()
            mask = covered.setdefault(name, torch.zeros(size, dtype=torch.bool))   # host: offline conversion
            mask[start:start + numel] = True
            for field, value in values.items():
                flat = whole.setdefault(field, {}).setdefault(
                    name, torch.zeros(size, dtype=torch.float32))   # host: offline conversion
                flat[start:start + numel].copy_(value.reshape(-1))
    for name, mask in covered.items():
        if not bool(mask.all()):
            raise CheckpointError(f"{input_folder}: parameter {name!r} is incomplete in the optimizer files "
                                  f"({int(mask.sum())} of {mask.numel()} elements): a rank's file is missing")
    first = loaded[0]
    steps = {s["step"] for s in loaded if s.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointError(f"{input_folder}: the optimizer files record different steps {sorted(steps)}")
    write_universal(output_folder, states, whole, shapes, steps, first["param_groups"], first.get("loss_scaler"))
    for source in glob.glob(os.path.join(input_folder, "layer_*_expert_*_model_states.pt")):
        shutil.copyfile(source, os.path.join(output_folder, os.path.basename(source)))
    return len(covered)


def write_universal(output_folder: str, states: dict, whole: dict[str, dict[str, torch.Tensor]], shapes: dict,
                    steps: set, param_groups: list[dict], loss_scaler: Any, raw_dense: bool = False) -> None:
    """Upstream's universal layout from whole values ({field: {name: flat tensor}}): `zero/<name>/<field>.pt`
    (AutoEP expert tensors with their markers; with `raw_dense` the other parameters as bare tensors, as
    upstream writes a ZeRO-3 tag's), `step.pt`, `zero/optimizer_state.pt`, and the model states `states`
    with every trained parameter, experts whole, in `param_shapes`."""
    prefixes = _expert_markers(states)
    zero_dir = os.path.join(output_folder, "zero")
    for name in sorted(whole["fp32"]):
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        extra = _markers(name, prefixes)
        for field, values in whole.items():
            if name in values:
                value = values[name].view(shapes[name])
                save_file(value if raw_dense and not extra else {PARAM: value, **extra},
                          os.path.join(folder, f"{field}.pt"))
        if steps:
            save_file(torch.tensor(float(next(iter(steps)))), os.path.join(folder, "step.pt"))  # host: a file
    common = {"param_groups": [dict(g, params=[i]) for i, g in enumerate(param_groups)]}
    if loss_scaler is not None:
        common["loss_scaler"] = loss_scaler
    save_file(common, os.path.join(zero_dir, "optimizer_state.pt"))
    # param_shapes names the trained parameters (the universal reader's list): the experts too, whole
    listed = [dict(g) for g in (states.get("param_shapes") or [{}])] or [{}]
    known = {n for g in listed for n in g}
    listed[-1].update({n: torch.Size(shapes[n]) for n in sorted(whole["fp32"]) if n not in known})
    save_file(dict(states, param_shapes=listed), os.path.join(output_folder, model_file()))


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
    write_universal(output_folder, states, whole, shapes, steps, source_groups(base["param_groups"]),
                    optim[0].get("loss_scaler"), raw_dense=True)
    return len(shapes)


def source_groups(saved: list[dict]) -> list[dict]:
    """The hyperparameters of each optimizer group of the engine that saved an AutoEP ZeRO-3 tag: the first
    sub-group each became (ours record which; in upstream's files each sub-group stands for itself)."""
    firsts: dict[int, dict] = {}
    for i, group in enumerate(saved):
        firsts.setdefault(int(group.get(AUTOEP_ZERO3_SOURCE_GROUP, i)), group)
    drop = {"params", AUTOEP_ZERO3_SOURCE_GROUP, "name", "moe"}
    return [{k: v for k, v in firsts[g].items() if k not in drop} for g in sorted(firsts)]
