# compat: upstream path deepspeed.checkpoint.universal_checkpoint (DeepSpeed 0.19.8 names).
"""Upstream's per-parameter restore of a universal checkpoint: `load_hp_checkpoint_state`, bound onto each
low-precision parameter (`enable_universal_checkpoint`), cuts this tensor rank's slice of every state out of
the whole tensor in `<folder>/<state>.pt` and places its ZeRO fragment; `_resolve_autotp_partition` reads the
parameter's AutoTP restore description (`ds_autotp_universal_checkpoint_meta`: partition dim, logical shape,
uneven `partition_sizes`, fused `sub_param_sizes` with per-rank `sub_param_shard_widths`, or an affine map).

Our engine does not restore through these (its loader plans every slice from the checkpoint's description,
runtime/checkpoint/loader.py); they are here for tools and tests written against upstream. The slice is cut
by the same rule our converter and TP re-slice use (`tp_maps.split_map`, [Note: affine maps] in affine.py);
upstream's contract raises AssertionError where the description cannot say how a rank was cut.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import List, Tuple, Union

import torch

from . import tp_maps
from .affine import SCALE_POWER_BY_STATE, ParamAffineMap
from .constants import (CAT_DIM, DS_AUTOTP_UC_META, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, FP32_WEIGHT_KEY, PARAM,
                        PARAM_N_SUB_PARAMS, SUB_PARAM_SHAPE, VOCAB_TENSOR)
from .files import CheckpointError


@dataclass
class SubparamShape:
    """A fused parameter's sub-parameters (upstream's record in a universal file's `sub_param_shape`): the
    sizes at `partition_dim` (a tuple, or before version 0.4 a count of equal blocks), -1 elsewhere allowed."""
    patterns: List[str]
    shape: Tuple[Union[Tuple[int], int]]
    partition_dim: int


def _get_param_uc_restore_meta(param):
    """The parameter's AutoTP restore description (its top-level fields; `conversion` holds the converter's)."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _name(param) -> str:
    return getattr(param, "ds_name", None) or f"the parameter of shape {tuple(param.shape)}"


def _rank_slice(full: torch.Tensor, shape, dim: int, blocks, widths, tp: int, rank: int, name: str) -> torch.Tensor:
    """Rank `rank`'s slice (flat) of `full` seen as `shape`, by the one layout rule (tp_maps.split_map)."""
    whole = full.reshape(shape)
    try:
        amap = tp_maps.split_map(whole.shape, dim, blocks, tp, widths, name)
    except CheckpointError as error:
        raise AssertionError(str(error)) from error
    return amap.extract(whole, rank).flatten()


def _resolve_autotp_partition(current_param, ckpt_dict, full_hp_param, tp_rank, tp_world_size, state_key="fp32"):
    """This tensor rank's slice (flat) of `full_hp_param` by the parameter's AutoTP restore description; None
    when it has none (or names no partition dim) and the caller's generic rule applies."""
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    name = _name(current_param)
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason"):
        raise RuntimeError(f"Cannot restore a universal checkpoint into {name}: {conversion['unsupported_reason']}")
    if conversion.get("affine_map") is not None:
        amap = ParamAffineMap.from_dict(conversion["affine_map"])
        if tp_rank in amap.pieces_by_rank and amap.numel == full_hp_param.numel():
            return amap.extract(full_hp_param, tp_rank, SCALE_POWER_BY_STATE.get(state_key, 1)).flatten()
    if meta.get("replicated", False):
        return full_hp_param.flatten()
    dim, shape = meta.get("partition_dim"), meta.get("logical_shape")
    if dim is None or shape is None:
        return None
    sizes, spec = meta.get("sub_param_sizes"), meta.get("sub_param_shape")
    if sizes is None and spec is not None:   # a view spec: its entry at the dim is sizes or (legacy) a count
        if hasattr(spec, "partition_dim"):
            dim, spec = spec.partition_dim, spec.shape
        sizes = spec[dim]
    try:
        blocks = None if sizes is None else tp_maps.sub_param_blocks(sizes, int(shape[dim]), name)
    except CheckpointError as error:
        raise AssertionError(str(error)) from error
    widths = meta.get("sub_param_shard_widths") if blocks is not None else meta.get("partition_sizes")
    return _rank_slice(full_hp_param, shape, dim, blocks, widths, tp_world_size, tp_rank, name)


def _described_slice(ckpt_dict: dict, full: torch.Tensor, tp: int, rank: int, name: str) -> torch.Tensor:
    """A rank's slice by what the universal file records (no restore description on the parameter): its
    fused `sub_param_shape`, `param_n_sub_params` equal blocks, else an even split along `cat_dim`."""
    sub = ckpt_dict.get(SUB_PARAM_SHAPE)
    if sub:
        dim = sub.partition_dim
        shape = list(full.reshape([sum(d) if isinstance(d, tuple) else d for d in sub.shape]).shape)
        return _rank_slice(full, shape, dim, tp_maps.sub_param_blocks(sub.shape[dim], shape[dim], name), None, tp,
                           rank, name)
    dim, count = ckpt_dict.get(CAT_DIM, 0), ckpt_dict.get(PARAM_N_SUB_PARAMS, 1)
    blocks = [full.shape[dim] // count] * count if count > 1 else None
    return _rank_slice(full, full.shape, dim, blocks, None, tp, rank, name)


def load_hp_checkpoint_state(self, folder, tp_rank, tp_world_size, ep_rank=0, ep_size=1):
    """Load every `<folder>/<state>.pt` of a universal checkpoint into this parameter's ZeRO fragment
    (`self._hp_mapping`): fp32 into the master fragment, optimizer states into `optim_fragment`. Returns the
    `step.pt` value (None without one)."""
    hp_mapping = self._hp_mapping
    hp_mapping.optim_fragment = {}
    described = _get_param_uc_restore_meta(self) is not None
    name = _name(self)
    step = None
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".pt"):
            continue
        key = file[:-len(".pt")]
        ckpt_dict = torch.load(os.path.join(folder, file), weights_only=False)
        if key == "step":
            step = ckpt_dict
            continue
        full = ckpt_dict[PARAM]
        if ckpt_dict.get(EP_IS_EXPERT_PARAM, False) and ep_size > 1:   # whole experts along dim 0
            experts = int(ckpt_dict.get(EP_NUM_EXPERTS, full.shape[0]))
            assert experts % ep_size == 0, f"{name}: {experts} experts are not divisible by ep_size {ep_size}"
            full = full.narrow(0, ep_rank * experts // ep_size, experts // ep_size)
        rank, tp = tp_rank, tp_world_size
        if full.shape == self.shape and not described:   # saved whole (replicated): this rank's copy
            rank, tp = 0, 1
        if ckpt_dict.get(VOCAB_TENSOR, False) and not described and self.shape[0] * tp > full.shape[0]:
            full = torch.nn.functional.pad(full, (0, 0, 0, self.shape[0] * tp - full.shape[0]))
        piece = _resolve_autotp_partition(self, ckpt_dict, full, rank, tp, state_key=key)
        if piece is None:
            assert full.numel() == tp * self.numel(), (f"{name}: {folder}/{file} holds {full.numel()} elements, not "
                                                        f"tp_world_size {tp} x this slice's {self.numel()}")
            piece = _described_slice(ckpt_dict, full, tp, rank, name)
        address = hp_mapping.lp_fragment_address
        fragment = piece.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            hp_mapping.get_hp_fragment().data.copy_(fragment.data)
        else:
            hp_mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def enable_universal_checkpoint(param_list):
    """Bind `load_hp_checkpoint_state` onto each parameter (upstream's optimizers do it at construction)."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)
