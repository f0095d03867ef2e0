"""DeepSpeed 0.19.8's `ds_to_universal` internals, by name, as adapters over our one rule for tensor slices.

Conversion tools and upstream's tests call these directly: `merge_tp_slices` over upstream's temporary slice
folders (`<slice_dir>/<param>/<tp rank>/<state>.<dp rank>`), `_merge_zero_shards`, `_group_per_tp_shapes`,
`_validate_autotp_conversion_support` and the small file helpers `main` looks up at call time. The layout of a
parameter comes from `tp_maps` ([Note: affine maps] in affine.py: a recorded map, else upstream's pattern
lists via `tp_maps.pattern_layout`), the same rule our converter and TP re-slice use; nothing here joins
slices on its own. Upstream's contracts raise AssertionError / ValueError, so ours are translated to those.
Re-exported by ds_to_universal.py.
"""

from __future__ import annotations

import glob
import math
import os
import re

import torch

from . import tp_maps
from .constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, CAT_DIM, OPTIMIZER_STATE_DICT, ORIGINAL_VOCAB_SIZE,
                        PARAM, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHAPE,
                        TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                        UNIVERSAL_CHECKPOINT_VERSION_VALUE, VOCAB_TENSOR, VOCABULARY_PARAMETER_PATTERNS, ZERO_STAGE)
from .files import CheckpointError, load_file

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def unsupported_layouts(info: dict | None) -> str | None:
    """The message refusing a checkpoint whose AutoTP description names layouts it cannot describe (e.g.
    CodeGen's interleaved qkv); None when it names none."""
    unsupported = (info or {}).get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if not unsupported:
        return None
    details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
    return f"AutoTP universal checkpoint conversion is not supported for {details}"


def _validate_autotp_conversion_support(universal_checkpoint_info: dict | None) -> None:
    message = unsupported_layouts(universal_checkpoint_info)
    if message:
        raise ValueError(message)


def _get_optim_files(checkpoint_dir: str) -> list[str]:
    """The tag's optimizer-states files in rank order ([] when it has none: a ZeRO-0 fp32 tag)."""
    key = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(p))]   # noqa: E731
    return sorted(glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt")), key=key)


def _filter_zero3_optim_files(optim_files: list[str]) -> list[str]:
    return [f for f in optim_files if re.match(r"(?:bf16_)?zero_pp_rank_", os.path.basename(f))]


def _get_zero_stage(optim_files: list[str]) -> int:
    return int(load_file(optim_files[0]).get(OPTIMIZER_STATE_DICT, {}).get(ZERO_STAGE, 1))


def _inject_missing_state(ds_checkpoint) -> None:
    """Upstream's --inject_missing_state: a checkpoint without a description gets the default one."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def _group_per_tp_shapes(slice_shapes_by_tp: list[dict], pp_degree: int, tp_degree: int) -> dict[str, list]:
    """{name: [shape on tensor rank t]} from per-file shapes numbered pipeline-major (file i is stage
    i // tp_degree, tensor rank i % tp_degree, as every writer numbers mp_rank files). A parameter in several
    stages' files (tied) must have one shape per tensor rank."""
    per_tp: list[dict] = [{} for _ in range(tp_degree)]
    for pp in range(pp_degree):
        for tp in range(tp_degree):
            for name, shape in slice_shapes_by_tp[pp * tp_degree + tp].items():
                seen = per_tp[tp].setdefault(name, shape)
                assert seen == shape, (f"Pipeline replicas of {name} on tp rank {tp} disagree on shape: {seen} (an "
                                       f"earlier stage) vs {shape} (stage {pp})")
    names = set().union(*per_tp) if per_tp else set()
    return {name: [d.get(name) for d in per_tp] for name in names}


def _merge_zero_shards(param_base_path: str, state: str, tp_degree: int, slice_shapes=None) -> list:
    """Each tensor rank's slice of one state, its data-parallel fragments (`<tp>/<state>.<dp>`) joined in dp
    order and shaped by `slice_shapes[tp]` when given. A rank that wrote no fragment stands in as an empty
    slice only when its recorded shape is empty: one that owns elements means the extraction lost data."""
    slices, missing = [], []
    for tp in range(tp_degree):
        prefix = os.path.join(param_base_path, str(tp), state)
        found = {}
        for path in glob.glob(f"{glob.escape(prefix)}.*"):
            suffix = path[len(prefix) + 1:]
            if not suffix.isdigit():
                raise ValueError(f"cannot read the data-parallel rank from fragment file {path}")
            found[int(suffix)] = path
        if not found:
            missing.append((tp, len(slices)))
            continue
        shards = [torch.load(found[dp], weights_only=False) for dp in sorted(found)]
        if state == "step":
            assert all(v == shards[0] for v in shards), f"{param_base_path}: the dp ranks' step values differ: {shards}"
            slices.append(shards[0])
            continue
        joined = torch.cat([s.reshape(-1) for s in shards])
        slices.append(joined if slice_shapes is None else joined.reshape(slice_shapes[tp]))
    if missing and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp, position in reversed(missing):
            shape = tuple(slice_shapes[tp])
            assert math.prod(shape) == 0, (f"{param_base_path}: tp rank {tp} wrote no {state} fragment, but its "
                                           f"recorded shape {shape} is not empty")
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype, device=slices[0].device))
    return slices


def _category_patterns(info: dict) -> set[str]:
    out = set()
    for key in (TP_REPLICATED_PARAMETER_PATTERNS, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                VOCABULARY_PARAMETER_PATTERNS):
        out.update(info.get(key) or [])
    for sub in info.get(PARAMETER_WITH_SUB_PARAMS) or []:
        out.update((sub if isinstance(sub, dict) else vars(sub)).get("patterns") or [])
    return out


def merge_tp_slices(uc_info: dict, dir: str, slice_dir: str, tp_degree: int, name_and_shapes) -> set[str]:
    """Write `<dir>/<name>/{step,fp32,exp_avg,exp_avg_sq}.pt` from the tensor ranks' slices under
    `<slice_dir>/<name>`, joined by the parameter's layout (its recorded affine map, else upstream's pattern
    lists with the per-rank shapes `name_and_shapes[1]`). Returns the category patterns `name` did not match
    (upstream's strict check intersects them over all parameters)."""
    from .universal_checkpoint import SubparamShape

    name, shapes = name_and_shapes
    source, target = os.path.join(slice_dir, name), os.path.join(dir, name)
    unmatched = {p for p in _category_patterns(uc_info) if not re.match(p, name)}
    os.makedirs(target, exist_ok=True)
    step = _merge_zero_shards(source, "step", tp_degree, shapes)
    if step:
        torch.save(step[0], os.path.join(target, "step.pt"))
    try:
        recorded = tp_maps.recorded_map({UNIVERSAL_CHECKPOINT_INFO: uc_info}, name, tp_degree)
        layout = None if recorded else tp_maps.pattern_layout(uc_info, name, shapes)
    except CheckpointError as error:
        raise AssertionError(str(error)) from error
    for state in _STATES:
        slices = _merge_zero_shards(source, state, tp_degree, shapes)
        if not slices:   # ZeRO keeps no optimizer state for a parameter that never had a gradient
            continue
        record = {}
        if recorded is not None:
            value = tp_maps.rebuild(recorded, name, dict(enumerate(slices)))
        else:
            amap, dim, blocks, pattern = layout
            value = tp_maps.rebuild(amap, name, dict(enumerate(slices)))
            if blocks:
                spec = list(next(s for s in uc_info[PARAMETER_WITH_SUB_PARAMS]
                                 if pattern in (s if isinstance(s, dict) else vars(s))["patterns"])["shape"])
                spec[dim] = tuple(blocks)
                record[SUB_PARAM_SHAPE] = SubparamShape(patterns=[pattern], shape=tuple(spec), partition_dim=dim)
            elif dim is not None:
                record[CAT_DIM] = dim
        vocab = any(re.match(p, name) for p in uc_info.get(VOCABULARY_PARAMETER_PATTERNS) or [])
        if vocab and uc_info.get(ORIGINAL_VOCAB_SIZE):   # the padding upstream's vocabulary layers add
            value = value[:int(uc_info[ORIGINAL_VOCAB_SIZE])]
            record[VOCAB_TENSOR] = True
        record[PARAM] = value
        torch.save(record, os.path.join(target, f"{state}.pt"))
    return unmatched
