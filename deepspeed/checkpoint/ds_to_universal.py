"""`ds_to_universal`: convert a checkpoint tag into DeepSpeed's universal (world-size free) layout.

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step10 \\
        --output_folder ckpt/global_step10_universal
    # writes ckpt/latest_universal too (as DeepSpeed's); load with checkpoint.load_universal

Output: `<out>/zero/<param name>/{fp32,exp_avg,exp_avg_sq,...}.pt` (each `{"param": full fp32
tensor}`), `<out>/zero/<param name>/step.pt`, `<out>/zero/optimizer_state.pt` (the state that
is not per element: loss scaler, param_groups, ...) and a copy of the model-states file.
Any input the reader understands works (ZeRO 0-3, any world size, ours or DeepSpeed's, every pipeline
stage, and tensor-parallel file sets: AutoTP's and a 3-D pipeline's slices of the masters and of every
optimizer field are joined into whole tensors, so the output loads at any TP size); one parameter is
held in memory at a time. Our engine loads either layout directly, so this is
only needed for tools that expect universal checkpoints.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass, field as dc_field

import torch

from ..utils.progress import progress
from ..utils.zero_to_fp32 import join_tp_slices
from . import tp_maps
from .deepspeed_checkpoint import _aggregate_autoep_zero12_metadata  # noqa: F401  (upstream's name, here)
from .constants import (CAT_DIM, PARAM, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                        UNIVERSAL_CHECKPOINT_VERSION_VALUE)
from .files import CheckpointError, model_file, save_file, write_text
from .moe_join import megatron_dims
from .moe_to_universal import convert_autoep_zero3, convert_moe, is_autoep_zero3_layout, is_moe_layout
from .reader import CheckpointReader
from .deepspeed_checkpoint import DeepSpeedCheckpoint
# upstream's internals by name (tools and its tests call them; `main` looks these up at call time)
from .upstream_universal import (_filter_zero3_optim_files, _get_optim_files, _get_zero_stage,  # noqa: F401
                                 _group_per_tp_shapes, _inject_missing_state, _merge_zero_shards,
                                 _validate_autotp_conversion_support, merge_tp_slices, unsupported_layouts)

_PER_ELEMENT = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings",
                "fp32_flat_groups", "optimizer_state_dict", "ds_fragments")


@dataclass
class _Unit:
    """One pipeline stage's file sets: one reader per saved tensor rank, and how its sliced parameters
    join (`dims`: the partition dim; `blocks`: a fused weight's block sizes along it; `maps`: the layouts
    upstream's pattern lists describe, [Note: affine maps])."""
    readers: list[CheckpointReader]
    dims: dict[str, int]
    blocks: dict[str, list[int]]
    maps: dict = dc_field(default_factory=dict)


def _open(input_folder: str, inject_missing_state: bool = False) -> list[_Unit]:
    """Every model-parallel file set of the tag: one unit per pipeline stage (each stage's files hold only
    its own layers' parameters, so all are read: reading stage 0 alone wrote a universal checkpoint missing
    every later stage's parameters), each with its tensor ranks' readers (AutoTP writes one `mp_rank_XX` set
    per tensor rank; a 3-D pipeline numbers them stage x tp + tensor rank). `inject_missing_state`: files
    that describe no partition dims get upstream's default description (each parameter split on dim 0)."""
    load_dir, tag = os.path.dirname(input_folder) or ".", os.path.basename(input_folder)
    first = CheckpointReader(load_dir, tag)
    if first.universal:
        raise CheckpointError(f"{input_folder} is already a universal checkpoint")
    listing = os.listdir(first.path)
    sets = sorted(int(m.group(1)) for m in (re.match(r"mp_rank_(\d+)_model_states\.pt$", f) for f in listing) if m)
    if not sets:   # ZeRO-3: per-rank model-states files
        sets = sorted({int(m.group(1)) for m in (re.match(r"zero_pp_rank_\d+_mp_rank_(\d+)_model_states\.pt$", f)
                                                  for f in listing) if m}) or [0]
    layers = [f for f in listing if re.match(r"layer_\d+-model_states\.pt$", f)]
    sliced = {m.group(1) for m in (re.match(r"layer_\d+-model_(\d+)-model_states\.pt$", f) for f in listing) if m}
    if sliced:
        tp = len(sliced)
    elif layers:
        tp = 1
    else:
        tp = len(sets)
    if len(sets) % tp:
        raise CheckpointError(f"{input_folder}: {len(sets)} model-parallel file sets are not a multiple of the "
                              f"tensor-parallel size {tp}")
    units = []
    for stage in range(len(sets) // tp):
        readers = [first if m == 0 else CheckpointReader(load_dir, tag, mp_rank=m)
                   for m in sets[stage * tp:(stage + 1) * tp]]
        units.append(_Unit(readers, *_partition_dims(input_folder, readers, inject_missing_state)))
    if len(units) > 1 and not all(r.optimizer_state for u in units for r in u.readers):
        raise CheckpointError(f"{input_folder}: a pipeline checkpoint without ZeRO / mixed-precision optimizer "
                              "partitions has nothing to convert; its per-layer files load at any stage count as they are")
    return units


def _partition_dims(where: str, readers: list[CheckpointReader], inject_missing_state: bool = False) -> tuple:
    """A stage's sliced parameters, from its model states: AutoTP's `tp_partition_dims` (and fused
    `tp_sub_param_sizes`), and the `partition_dim` your Megatron-style layers tag; else upstream's pattern
    lists (`universal_checkpoint_info`)."""
    states, tp = readers[0].model_states, len(readers)
    dims = dict(states.get("tp_partition_dims") or {})
    dims.update(megatron_dims(where, states))
    info = states.get(UNIVERSAL_CHECKPOINT_INFO) or (
        {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE} if inject_missing_state else None)
    if tp > 1 and not dims and info:
        return _dims_from_patterns(info, [_shapes(r) for r in readers])
    if tp > 1 and not dims:
        raise CheckpointError(f"{where} holds {tp} tensor-parallel file sets per stage, but its model states name "
                              "no partition dims (tp_partition_dims); cannot join the slices")
    return dims, dict(states.get("tp_sub_param_sizes") or {})


def _dims_from_patterns(info: dict, shapes: list[dict]) -> tuple[dict, dict, dict]:
    """DeepSpeed's own AutoTP checkpoints describe their slices by name patterns (`universal_checkpoint_info`):
    each parameter's layout from them and the tensor ranks' slice shapes (`shapes`: {name: shape} per tensor
    rank; tp_maps.pattern_layout: uneven splits, fused blocks with their recorded per-rank widths, legacy
    sub-parameter counts)."""
    dims, blocks, maps = {}, {}, {}
    for name in shapes[0]:
        maps[name], dim, fused, _ = tp_maps.pattern_layout(info, name, [s[name] for s in shapes])
        if dim is not None:
            dims[name] = dim
        if fused:
            blocks[name] = fused
    return dims, blocks, maps


def _shapes(reader: CheckpointReader) -> dict[str, torch.Size]:
    return {name: shape for group in reader.groups() for name, shape in group}


def _joined(unit: _Unit, name: str, read) -> torch.Tensor | None:
    """Parameter `name` whole: `read(reader)` of each tensor rank put together by the affine map the checkpoint
    records for it ([Note: affine maps] in affine.py; only the ranks it needs are read: rank 0 of a replicated
    one), else joined along its partition dim (rank 0's value when it is replicated); None when a rank has no
    value. ZeRO-3's empty module placeholders stay one empty placeholder."""
    tp = len(unit.readers)
    amap = (tp_maps.recorded_map(unit.readers[0].model_states, name, tp) or unit.maps.get(name)) if tp > 1 else None
    ranks = tp_maps.source_ranks(amap) if amap is not None else range(tp) if name in unit.dims else [0]
    slices = [read(unit.readers[r]) for r in ranks]
    if any(s is None for s in slices):
        return None
    if len(slices) == 1 and amap is None or all(s.numel() == 0 for s in slices):
        return slices[0]
    if amap is not None:
        return tp_maps.rebuild(amap, name, dict(zip(ranks, slices)))
    return join_tp_slices(slices, unit.dims[name], unit.blocks.get(name))


def _record(name: str, unit: _Unit, value: torch.Tensor, zero3: bool) -> dict | torch.Tensor:
    """A universal file's content: the whole value, and (as upstream's converter) the dim its tensor
    slices were joined on, which upstream's load_universal re-cuts along at any TP size when the running
    parameter carries no AutoTP description (a fused weight is re-cut by that description). A ZeRO-3 tag
    without tensor parallelism gets upstream's bare flat tensor (both loaders read either form)."""
    if zero3 and len(unit.readers) == 1:
        return value.reshape(-1)
    out = {PARAM: value}
    if name in unit.dims and len(unit.readers) > 1 and not unit.blocks.get(name):
        out[CAT_DIM] = unit.dims[name]
    return out


def _model_states(unit: _Unit, stages: int) -> dict:
    """Tensor rank 0's model states with every sliced module entry whole: the universal checkpoint has
    no tensor ranks (`mp_world_size` is the stage count), so any TP size cuts its own slices from it."""
    reader = unit.readers[0]
    states = dict(reader.model_states)
    module = dict(states.get("module") or {})
    for key in module:
        if key in unit.dims and len(unit.readers) > 1:
            module[key] = _joined(unit, key, lambda r, k=key: (r.model_states.get("module") or {}).get(k))
    states["module"] = module
    if len(unit.readers) > 1:
        states["mp_world_size"] = stages
        info = dict(states.get(UNIVERSAL_CHECKPOINT_INFO) or {})
        if info:
            states[UNIVERSAL_CHECKPOINT_INFO] = info
    if "frozen_param_shapes" in states and reader.stage == 3:   # each frozen parameter whole, not rank 0's piece
        frozen = states.get("frozen_param_shapes") or {}
        states["frozen_param_fragments"] = {n: _joined(unit, n, lambda r, n=n: r.module_tensor(n)) for n in frozen} \
            if frozen else None
    return states


def convert(input_folder: str, output_folder: str, inject_missing_state: bool = False) -> int:
    """Write the universal checkpoint of tag directory `input_folder`; returns the parameter count.
    `inject_missing_state`: as upstream's flag, a tensor-parallel checkpoint that describes none of its slices
    is taken to split every parameter on dim 0."""
    input_folder = os.path.normpath(input_folder)
    moe, autoep3 = is_moe_layout(input_folder), is_autoep_zero3_layout(input_folder)
    if moe or autoep3:   # AutoEP / deepspeed.moe: named pieces or AutoEP ZeRO-3 partitions; whole expert tensors
        os.makedirs(output_folder, exist_ok=True)
        count = (convert_moe if moe else convert_autoep_zero3)(input_folder, output_folder)
        _write_latest(output_folder)
        return count
    units = _open(input_folder, inject_missing_state)
    refused = unsupported_layouts(units[0].readers[0].model_states.get(UNIVERSAL_CHECKPOINT_INFO))
    if refused:
        raise CheckpointError(f"{input_folder}: {refused}")
    reader = units[0].readers[0]
    zero3 = not os.path.isfile(os.path.join(reader.path, model_file()))
    zero_dir = os.path.join(output_folder, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    owners: dict[str, int] = {}   # a tied weight is in several stages' files: once
    for stage, unit in enumerate(units):
        for name in _shapes(unit.readers[0]):
            owners.setdefault(name, stage)
    for name, stage in progress(list(owners.items()), desc="Converting to universal", unit="param"):
        unit = units[stage]
        source = unit.readers[0]
        folder = os.path.join(zero_dir, name)
        os.makedirs(folder, exist_ok=True)
        for field in ["fp32"] + source.fields():
            value = _joined(unit, name, lambda r, f=field: _read(r, name, f))
            if value is not None:
                save_file(_record(name, unit, value, zero3), os.path.join(folder, f"{field}.pt"))
        if source.step is not None:
            save_file(torch.tensor(float(source.step)), os.path.join(folder, "step.pt"))  # host: a file
    common = {}
    if reader.optimizer_state:
        common = {k: v for k, v in reader.optimizer_state[0].items() if k not in _PER_ELEMENT}
    common["param_groups"] = [dict(g, params=[i]) for i, g in enumerate(reader.param_groups)]
    save_file(common, os.path.join(zero_dir, "optimizer_state.pt"))
    tp = len(units[0].readers)
    for stage, unit in enumerate(units):   # every stage's counters and scheduler, as upstream copies mp_rank_*
        if tp == 1 and not zero3:
            shutil.copyfile(os.path.join(reader.path, model_file(stage)), os.path.join(output_folder, model_file(stage)))
        else:
            save_file(_model_states(unit, len(units)), os.path.join(output_folder, model_file(stage)))
    _write_latest(output_folder)
    return len(owners)


def _write_latest(output_folder: str) -> None:
    parent = os.path.dirname(os.path.normpath(output_folder)) or "."
    write_text(os.path.join(parent, "latest_universal"), os.path.basename(os.path.normpath(output_folder)))


def _read(reader: CheckpointReader, name: str, field: str) -> torch.Tensor | None:
    """`field` of this tensor rank's slice of `name`, in the slice's shape."""
    value = reader.read(name, field)
    return None if value is None else value.view(_shapes(reader)[name])


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    """The command line; `argv` may also be the parsed arguments (an object with `input_folder` and
    `output_folder`), as DeepSpeed's `main(args)` takes them (its tests call it so)."""
    if hasattr(argv, "input_folder"):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.split("\n")[0])
        parser.add_argument("--input_folder", required=True, help="checkpoint tag directory, e.g. ckpt/global_step10")
        parser.add_argument("--output_folder", required=True, help="universal checkpoint directory to create")
        # accepted for command-line compatibility with DeepSpeed's script; conversion is sequential here
        parser.add_argument("--num_extract_workers", type=int, default=4)
        parser.add_argument("--num_merge_workers", type=int, default=2)
        parser.add_argument("--keep_temp_folder", action="store_true")
        parser.add_argument("--strict", dest="strict", action="store_true", default=True)
        parser.add_argument("--no_strict", dest="strict", action="store_false")
        parser.add_argument("--inject_missing_state", action="store_true",
                            help="a tensor-parallel checkpoint describing none of its slices: split each on dim 0")
        args = parser.parse_args(argv)
    return _run(args.input_folder, args.output_folder, bool(getattr(args, "inject_missing_state", False)))


def _injected_preflight(input_folder: str) -> None:
    """Upstream's steps before a conversion with --inject_missing_state, through its helpers (looked up here
    at call time): at ZeRO 1-2 the description, injected when missing, still refuses unsupported layouts."""
    optim_files = _get_optim_files(input_folder)
    if not optim_files or _get_zero_stage(_filter_zero3_optim_files(optim_files) or optim_files) > 2:
        return
    checkpoint = DeepSpeedCheckpoint(input_folder)
    _inject_missing_state(checkpoint)
    _validate_autotp_conversion_support(checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO))


def _run(input_folder: str, output_folder: str, inject_missing_state: bool = False) -> int:
    try:
        if inject_missing_state:
            _injected_preflight(input_folder)
        count = convert(input_folder, output_folder, inject_missing_state)
    except CheckpointError as error:
        print(f"ds_to_universal: {error}", file=sys.stderr)
        return 2
    print(f"ds_to_universal: wrote {count} parameters to {os.path.join(output_folder, 'zero')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
