"""engine.save_16bit_model: the model's weights in their training dtype, one file, for inference.

At stages 0-2 every rank holds full parameters, so rank 0 writes `module.state_dict()`; the
other ranks only take part in the arrival check and the final agreement (a call on one rank
fails instead of hanging, and an error on rank 0 is raised on every rank). Tied parameters are
written once per name with their own storage (safetensors refuses shared storage). A
`.safetensors` file name writes safetensors.

At stage 3 parameters are partitioned, so the weights are gathered only when
`zero_optimization.stage3_gather_16bit_weights_on_model_save` is true (save_16bit_model returns
False on every rank otherwise, writing nothing: upstream's behaviour). Units are gathered one at
a time, in unit order on every rank (one all-gather each, from the shards); rank 0 keeps a CPU
copy of each unit's tensors, the other ranks drop them at once, so the extra memory per rank is
one gathered unit (plus, on rank 0, the CPU result). `_zero3_consolidated_16bit_state_dict`
gathers whatever the flag says, as upstream. Keys and order are `module.state_dict()`'s: every
name of a tied parameter gets its value, buffers come from the module.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ... import comm as ds_comm
from ...checkpoint import files
from ...utils.logging import log_dist, logger
from .agree import raise_if_any
from .view import CheckpointView
from .writer import own_storage

_ALL_RANKS = "all ranks must call save_16bit_model (it is collective under ZeRO), not only rank 0."


def consolidated_16bit_state_dict(view: CheckpointView, exclude_frozen_parameters: bool = False) -> dict | None:
    """The full state dict on rank 0 (None elsewhere); every rank must call it."""
    ds_comm.arrive_and_wait("_zero3_consolidated_16bit_state_dict", hint=_ALL_RANKS)
    if view.stage3 is not None:
        return _gathered_state_dict(view, exclude_frozen_parameters)
    from ...module_inject.layers import gather_full_state_dict, tp_layers

    # AutoTP: the whole weights, all-gathered over each tensor-parallel group (every rank takes part)
    state = gather_full_state_dict(view.module) if tp_layers(view.module) else view.module.state_dict()
    if view.global_rank != 0:
        return None
    frozen = {n for n, p in view.module.named_parameters() if not p.requires_grad}
    return {k: own_storage(v) for k, v in state.items() if not (exclude_frozen_parameters and k in frozen)}


def _gathered_state_dict(view: CheckpointView, exclude_frozen_parameters: bool) -> dict | None:
    """ZeRO-3: `module.state_dict()` with every parameter gathered from its unit's shards, on
    rank 0 (None elsewhere). Collective: one all-gather per unit holding a wanted parameter."""
    from ...module_inject.layers import tp_layers
    from .autoep_io import autoep_params, whole_rows
    from .zero3_io import gathered_params

    rank0 = view.global_rank == 0
    wanted = {id(p) for p in view.module.parameters() if p.requires_grad or not exclude_frozen_parameters}
    # AutoTP: a gathered ZeRO-3 parameter is still this tensor rank's slice; all-gather it over the TP group
    sliced = {id(p): (layer, dim) for layer in tp_layers(view.module) for p, dim in layer.sharded_params()}
    # AutoEP: a gathered expert parameter holds this EP rank's experts; all-gather them over the EP group
    named = dict(view.module.named_parameters())
    experts = {id(named[n]): layer for n, (_, layer) in autoep_params(view).items()}

    def whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if id(p) in sliced:
            return sliced[id(p)][0].full_param(value, sliced[id(p)][1])
        return whole_rows(experts[id(p)], value) if id(p) in experts else value

    gathered = gathered_params(view, lambda p: id(p) in wanted, keep=lambda p: rank0, whole=whole)
    if not rank0:
        return None
    state, copies = {}, {}
    # keep_vars: the parameters themselves, so every name of a tied parameter finds its value
    for name, value in view.module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            if id(value) in wanted:
                state[name] = gathered[id(value)]
        else:
            state[name] = own_storage(value, copies)
    return state


def save_16bit_model(view: CheckpointView, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    if not save_dir:
        raise ValueError(f"save_16bit_model: save_dir must be a non-empty path, got {save_dir!r}")
    if view.stage3 is not None and not view.gather_16bit_weights:
        if view.global_rank == 0:
            logger.warning(f"save_16bit_model: did not save {os.path.join(save_dir, save_filename)}: under ZeRO "
                           "stage 3 the parameters are partitioned and "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so they are "
                           "not gathered. Set it to true to save the 16-bit weights, or use save_checkpoint "
                           "and zero_to_fp32 (deepspeed.utils.zero_to_fp32) to get fp32 weights.")
        return False
    state = consolidated_16bit_state_dict(view, exclude_frozen_parameters)
    error = None
    if state is not None:
        try:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                _save_safetensors(state, path)
            else:
                files.save_file(state, path)
            log_dist(f"Saved 16-bit model weights to {path}", ranks=[0])
        except Exception as e:  # raised on every rank below
            error = e
    # agreed: every rank raises rank 0's error (with its message), none waits for a failed peer
    raise_if_any(error, f"save_16bit_model: writing {save_dir}/{save_filename}")
    return True


def _save_safetensors(state: dict, path: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(f"save_16bit_model: {os.path.basename(path)} asks for safetensors, which is not "
                          "installed: pip install safetensors (or use a .bin file name)") from e
    tmp = path + ".tmp"
    seen: set[int] = set()
    tensors = {}
    for name, value in state.items():  # tied weights: each name gets its own copy
        value = value.contiguous()
        if value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        tensors[name] = value
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
    except BaseException:
        if os.path.exists(tmp):  # no partial file left behind
            os.remove(tmp)
        raise
    os.replace(tmp, path)
