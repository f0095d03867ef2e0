"""AutoEP expert parameters in DeepSpeed's universal-checkpoint conversion (its module path).

DeepSpeed's converter first splits every ZeRO-1/2 optimizer file into per-DP-rank fragment files,
`<temp>/<param>/0/<state>.<dp:02d>`; an AutoEP expert parameter's fragments on the DP ranks of one
EP rank hold that rank's experts. `consolidate_autoep_zero12_expert_states` joins them into the
whole [num_experts, ...] tensor per state (fp32, exp_avg, exp_avg_sq), written as universal files
marked as expert tensors, and the step. (This package's own converter, ds_to_universal.py, reads
checkpoints through CheckpointReader and writes whole tensors directly.)

[Note: folding metadata]
A checkpoint of AutoEP folded with AutoTP ([Note: EP x TP folding] in moe/tp_tokens.py) records its
layout in every file it writes, under `folding` (upstream's keys, constants.py): the tensor and
expert sizes and this writer's ranks, the expert tensor-parallel size (1: experts are whole), which
group the file's ZeRO partition runs over ("dense_dp" for the model states, "edp" for experts,
"per_family" for an optimizer file holding both) and its family ("dense", "routed_expert",
"zero_optimizer_state"). A reader checks it against its own layout before reading anything
(`validate_folding_metadata`): a folded checkpoint resumes only at the layout that wrote it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import glob

from .constants import (CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, FOLDING_DISPATCH_STRATEGY, FOLDING_EP_RANK,
                        FOLDING_EP_SIZE, FOLDING_ETP_RANK, FOLDING_ETP_SIZE, FOLDING_FAMILY, FOLDING_METADATA_KEY,
                        FOLDING_METADATA_VERSION, FOLDING_PARAM_FAMILIES, FOLDING_SHARED_EXPERT_PLACEMENT,
                        FOLDING_TP_RANK, FOLDING_TP_SIZE, FOLDING_ZERO_PARTITION_COUNT, FOLDING_ZERO_PARTITION_GROUP,
                        FOLDING_ZERO_PARTITION_RANK, PARAM)

# what this build's folding does: each expert whole on one rank of its EP group (tokens of every tensor peer
# routed to it), the tensor-parallel layers (shared experts among them) sliced as AutoTP slices them
DISPATCH_STRATEGY = "route_full_partition_dispatch"
SHARED_EXPERT_PLACEMENT = "tp_sharded"

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _zero12_fragment_path(temp_dir: str, param_name: str, state_name: str, dp_rank: int) -> str:
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:02d}")


def autoep_zero12_dp_ranks(ep_rank: int, dp_degree: int, ep_size: int, use_data_before_expert_parallel: bool) -> range:
    """The DP ranks holding EP rank `ep_rank`'s experts: strided by ep (EP groups of consecutive
    ranks, the default), or a consecutive block (use_data_before_expert_parallel)."""
    if dp_degree % ep_size:
        raise RuntimeError(f"ZeRO DP degree {dp_degree} is not divisible by autoep_size {ep_size}")
    if use_data_before_expert_parallel:
        block = dp_degree // ep_size
        return range(ep_rank * block, (ep_rank + 1) * block)
    return range(ep_rank, dp_degree, ep_size)


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def consolidate_autoep_zero12_expert_states(temp_dir: str, output_dir: str, expert_param_info: dict, slice_shapes: dict,
                                            dp_degree: int, tp_degree: int,
                                            use_data_before_expert_parallel: bool) -> None:
    """For each expert parameter (`expert_param_info[name]`: num_experts, num_local_experts, ep_size;
    `slice_shapes[name]`: one EP rank's shape), write `<output>/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`
    (the whole tensor, experts in order) and `step.pt`."""
    if tp_degree != 1:
        raise NotImplementedError("AutoEP ZeRO-1/2 universal conversion with tensor parallelism is not supported")
    for name, info in expert_param_info.items():
        if name not in slice_shapes:
            raise RuntimeError(f"AutoEP expert parameter {name} has no shape in the checkpoint")
        shape, ep, experts = tuple(slice_shapes[name]), info["ep_size"], info["num_experts"]
        if not shape or shape[0] != info["num_local_experts"]:
            raise RuntimeError(f"AutoEP {name}: slice shape {shape} does not hold num_local_experts="
                               f"{info['num_local_experts']}")
        out = os.path.join(output_dir, "zero", name)
        os.makedirs(out, exist_ok=True)
        for state in STATES:
            pieces = []
            for ep_rank in range(ep):
                paths = [_zero12_fragment_path(temp_dir, name, state, d)
                         for d in autoep_zero12_dp_ranks(ep_rank, dp_degree, ep, use_data_before_expert_parallel)]
                flat = [_load(p).flatten() for p in paths if os.path.isfile(p)]
                local = torch.cat(flat) if flat else torch.empty(0)  # host: offline checkpoint conversion
                if local.numel() != torch.Size(shape).numel() or (flat and local.dtype != torch.float32):
                    raise RuntimeError(f"AutoEP {name} {state}: EP rank {ep_rank}'s fragments hold {local.numel()} "
                                       f"{local.dtype} values, expected {torch.Size(shape).numel()} fp32")
                pieces.append(local.view(shape))
            torch.save({PARAM: torch.cat(pieces), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: experts},
                       os.path.join(out, f"{state}.pt"))
        steps = [_load(p) for p in (_zero12_fragment_path(temp_dir, name, "step", d) for d in range(dp_degree))
                 if os.path.isfile(p)]
        first = torch.as_tensor(steps[0]) if steps else None   # host: offline conversion
        if first is None or any(not torch.equal(torch.as_tensor(s), first) for s in steps):  # host: offline
            raise RuntimeError(f"AutoEP {name}: the optimizer step is missing or differs across DP ranks ({steps})")
        torch.save(steps[0], os.path.join(out, "step.pt"))


def make_folding_metadata(*, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, zero_partition_group: str,
                          zero_partition_rank: int, zero_partition_count: int, family: str,
                          param_families: dict | None = None) -> dict:
    """One file's `folding` record ([Note: folding metadata]); experts are never tensor-sliced (etp 1)."""
    out = {"version": FOLDING_METADATA_VERSION, FOLDING_TP_SIZE: tp_size, FOLDING_TP_RANK: tp_rank,
           FOLDING_EP_SIZE: ep_size, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_SIZE: 1, FOLDING_ETP_RANK: 0,
           FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
           FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_DISPATCH_STRATEGY: DISPATCH_STRATEGY,
           FOLDING_SHARED_EXPERT_PLACEMENT: SHARED_EXPERT_PLACEMENT, FOLDING_FAMILY: family}
    if param_families is not None:
        out[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return out


def validate_folding_metadata(metadata: Any, *, tp_size: int, ep_size: int, etp_size: int = 1,
                              **expected: Any) -> dict:
    """The `folding` record of a loaded file (`metadata`: the file's dict), checked against the reader's
    layout: tp/ep/etp sizes always, and each other key given (tp_rank, ep_rank, etp_rank,
    zero_partition_group/rank/count, family, param_families, shared_expert_placement, dispatch_strategy;
    None: not checked). RuntimeError naming the key, the saved and the runtime value."""
    if not isinstance(metadata, dict) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint: the file has no "
                           f"'{FOLDING_METADATA_KEY}' record (saved without expert x tensor folding?)")
    folding = metadata[FOLDING_METADATA_KEY]
    if not isinstance(folding, dict) or folding.get("version") != FOLDING_METADATA_VERSION:
        version = folding.get("version") if isinstance(folding, dict) else folding
        raise RuntimeError(f"AutoEP+AutoTP folding metadata version {version!r} is not supported (this build "
                           f"reads version {FOLDING_METADATA_VERSION})")
    known = {FOLDING_TP_RANK, FOLDING_EP_RANK, FOLDING_ETP_RANK, FOLDING_ZERO_PARTITION_GROUP,
             FOLDING_ZERO_PARTITION_RANK, FOLDING_ZERO_PARTITION_COUNT, FOLDING_FAMILY, FOLDING_PARAM_FAMILIES,
             FOLDING_SHARED_EXPERT_PLACEMENT, FOLDING_DISPATCH_STRATEGY}
    unknown = sorted(set(expected) - known)
    if unknown:
        raise TypeError(f"validate_folding_metadata: unknown keys {unknown}; allowed: {sorted(known)}")
    wanted = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size}
    wanted.update({k: v for k, v in expected.items() if v is not None})
    for key, value in wanted.items():
        if folding.get(key) != value:
            raise RuntimeError(f"AutoEP+AutoTP folding metadata mismatch for {key}: saved={folding.get(key)!r}, "
                               f"runtime={value!r} (a folded checkpoint resumes at the layout that saved it)")
    return folding


def expert_file_path(checkpoint_dir: str, layer: int, expert: int) -> str:
    """The one `layer_{layer}_expert_{expert}_mp_rank_*` file of a checkpoint. Several files (tensor
    ranks' shards or copies) are not joined here: NotImplementedError, which for a folded checkpoint
    says so; none: FileNotFoundError."""
    found = sorted(glob.glob(os.path.join(checkpoint_dir, f"layer_{layer}_expert_{expert}_mp_rank_*_model_states.pt")))
    if not found:
        raise FileNotFoundError(f"{checkpoint_dir}: no expert file for layer {layer}, expert {expert} "
                                f"(layer_{layer}_expert_{expert}_mp_rank_*_model_states.pt)")
    if len(found) > 1:
        if any(FOLDING_METADATA_KEY in _load(f) for f in found):
            raise NotImplementedError(f"universal conversion of folded AutoEP+AutoTP expert shards is not supported: "
                                      f"{[os.path.basename(f) for f in found]} hold expert {expert} of layer {layer} "
                                      "on several tensor ranks; load the checkpoint at the folded layout that saved "
                                      "it, or consolidate it with zero_to_fp32")
        raise NotImplementedError(f"{checkpoint_dir}: expert {expert} of layer {layer} is in several mp_rank files "
                                  f"{[os.path.basename(f) for f in found]}; one per expert is supported")
    return found[0]


def consolidate_autoep_expert_files(checkpoint_dir: str, output_dir: str, autoep_layers_metadata: Any,
                                    fp32_fallback_param_names: Any = None, fp32_fallback_dir: Any = None) -> None:
    """Universal files `<output>/zero/<prefix>.<w>/fp32.pt` of each AutoEP layer (`autoep_layers_metadata`:
    the model states' `ds_autoep_layers`) from its per-expert files `<prefix>.<w>.<expert>` (upstream's
    AutoEPMoELayer keys, w in w1 w2 w3): the experts stacked in order. Only the names in
    `fp32_fallback_param_names` when given, written under `fp32_fallback_dir` if that is given."""
    if not isinstance(autoep_layers_metadata, list):
        raise RuntimeError(f"AutoEP layer metadata (ds_autoep_layers) must be a list of layer records, got "
                           f"{type(autoep_layers_metadata).__name__}: the checkpoint has none to consolidate")
    for info in autoep_layers_metadata:
        missing = [k for k in ("moe_layer_id", "num_experts", "expert_key_prefix") if k not in info]
        if missing:
            raise RuntimeError(f"AutoEP layer metadata {info} lacks {missing}")
        layer, prefix = info["moe_layer_id"], info["expert_key_prefix"]
        sources = [expert_file_path(checkpoint_dir, layer, e) for e in range(info["num_experts"])]
        for w in ("w1", "w2", "w3"):
            name = f"{prefix}.{w}"
            if fp32_fallback_param_names is not None and name not in fp32_fallback_param_names:
                continue
            rows = []
            for e, source in enumerate(sources):
                saved = _load(source)
                if f"{name}.{e}" not in saved:
                    raise RuntimeError(f"{source} has no '{name}.{e}' (it holds {sorted(saved)})")
                rows.append(saved[f"{name}.{e}"])
            out = os.path.join(fp32_fallback_dir or os.path.join(output_dir, "zero"), name)
            os.makedirs(out, exist_ok=True)
            torch.save({PARAM: torch.stack(rows).float(), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                        EP_NUM_EXPERTS: info["num_experts"]}, os.path.join(out, "fp32.pt"))
