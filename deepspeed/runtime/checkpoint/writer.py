"""Build the dictionaries of DeepSpeed's checkpoint files from the engine (docs/checkpoint_format.md).

* `<tag>/mp_rank_00_model_states.pt` (rank 0): module weights, counters, LR scheduler, config,
  parameter shapes per optimizer group, client state.
* `<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (every rank, ZeRO stages 1-2 and
  mixed precision at stage 0): rank r's slice of each param group flattened and padded to a
  multiple of 2N (DeepSpeed's layout, `BucketPartition(..., alignment=2)`), for the fp32
  masters and every optimizer state. Our runtime shards per bucket instead (1.0x DDP's bytes);
  the slices are re-cut here with one all-to-all for all fields (HpState.recut_fields), so the files are
  exactly what DeepSpeed writes and its tools read them.
* Stage 0 fp32: the torch optimizer's own state_dict inside the model-states file, as DeepSpeed.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from ... import comm as ds_comm
from ...checkpoint.description import FRAGMENTS_KEY, Description
from ...version import __version__
from .hp_state import HpState, upstream_scaler  # noqa: F401 (upstream_scaler: re-exported)
from .view import CheckpointView
from .parallel_dims import recorded_parallel_dims
from .zero3_io import param_shapes


def model_states(view: CheckpointView, hp: HpState | None, client_state: dict, exclude_frozen: bool,
                 partitioned: bool, zero3_frozen: dict | None = None, snapshot: bool = False) -> dict:
    """The model-states dictionary (DeepSpeed's keys, then the client's). At stage 3 parameters
    are released placeholders (saved empty, as DeepSpeed does) and `zero3_frozen` holds this
    rank's pieces of the frozen ones (zero3_io.frozen_fragments). With `snapshot` no tensor in it
    aliases state that training changes (for a background write)."""
    module = view.module
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    copies: dict[tuple, torch.Tensor] = {}  # tied weights stay one tensor (one storage) in the file
    state = {k: own_storage(v, copies, snapshot) for k, v in module.state_dict().items()
             if not (exclude_frozen and k in frozen)}
    if zero3_frozen is not None:  # every parameter saved as an empty placeholder (persistent ones too):
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}  # values live elsewhere
        # by tensor: a parameter's other state-dict names (AutoEP's router alias) get the same placeholder
        empty = {id(v): v.new_empty(0) for k, v in state.items() if k in params}
        state = {k: empty.get(id(v), v) for k, v in state.items()}
    buffers = [n for n, _ in _persistent_buffers(module)]
    shared = _shared_params(module)
    zero_frozen = view.zero_stage >= 2 and not exclude_frozen
    named = dict(module.named_parameters())
    if zero3_frozen is not None:
        shapes = param_shapes(view)
        frozen_shapes = OrderedDict((n, shapes[n]) for n in named if n in frozen) if zero_frozen else None
        frozen_fragments = zero3_frozen if zero_frozen else None
    else:
        ordered = sorted(frozen, key=list(named).index)
        frozen_shapes = OrderedDict((n, named[n].shape) for n in ordered) if zero_frozen else None
        frozen_fragments = OrderedDict((n, own_storage(named[n], copies, snapshot)) for n in ordered) \
            if zero_frozen else None
    out = dict(
        module=None if view.pipeline else state,   # pipelines: layer files
        buffer_names=buffers,
        optimizer=_optimizer_state_dict(hp.base, snapshot) if hp is not None and not partitioned else None,
        param_shapes=[OrderedDict((n, s) for n, s in g) for g in hp.groups] if hp is not None else None,
        frozen_param_shapes=frozen_shapes,
        shared_params=shared,
        frozen_param_fragments=frozen_fragments,
        lr_scheduler=copy.deepcopy(view.lr_scheduler.state_dict()) if view.lr_scheduler is not None and
        hasattr(view.lr_scheduler, "state_dict") else None,
        data_sampler=None,
        random_ltd=None,
        sparse_tensor_module_names=set(),
        skipped_steps=view.counters.skipped_steps,
        global_steps=view.counters.global_steps,
        global_samples=view.counters.global_samples,
        dp_world_size=view.dp_world_size,
        mp_world_size=view.mp_world_size,
        ds_config=view.ds_config,
        ds_version=__version__,
        ds_layout=None,   # engine_io: the optimizer-state files' description ([Note: a checkpoint describes itself])
    )
    tp_dims, tp_blocks = _tp_partition_dims(module)
    if tp_dims:
        out["tp_partition_dims"] = tp_dims   # zero_to_fp32 joins the tensor ranks' slices along these
    if tp_blocks:
        out["tp_sub_param_sizes"] = tp_blocks   # fused weights: joined block by block
    sliced = {n: d for n, d in _megatron_partition_dims(module).items() if n not in tp_dims}   # AutoTP's own
    if sliced:   # zero_to_fp32 joins the tensor slices of your layers (3-D, client mpu) along these
        out[MEGATRON_TP_DIMS] = sliced
    if hp is not None:
        out["optimizer_param_names"] = hp.optimizer_names
    reserved = set(out) & set(client_state)
    if reserved:
        raise KeyError(f"save_checkpoint: client_state uses reserved checkpoint keys {sorted(reserved)}")
    out.update(_universal_info(module, out.get(MEGATRON_TP_DIMS), out["mp_world_size"]))
    out.update(recorded_parallel_dims(view.mpu, view.grid, view.mp_world_size))   # checkpoint_parallel_dimensions
    out.update(client_state)
    return out


def own_storage(tensor: torch.Tensor, copies: dict | None = None, snapshot: bool = False) -> torch.Tensor:
    """A CPU tensor that owns exactly its elements: torch.save writes a view's whole storage, and
    under ZeRO parameters are views of flat bucket buffers. `copies` makes views of the same
    elements (tied weights) come out as one tensor. `snapshot`: always a copy, never the tensor
    itself (training may change it while a background thread writes)."""
    tensor = tensor.detach()
    key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    if copies is not None and key in copies:
        return copies[key]
    if tensor.device.type != "cpu":
        out = tensor.cpu()
    elif snapshot or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        out = tensor.clone()
    else:
        out = tensor
    if copies is not None:
        copies[key] = out
    return out


def _optimizer_state_dict(optimizer: torch.optim.Optimizer, snapshot: bool) -> dict:
    """The torch optimizer's state_dict (stage 0 fp32); with `snapshot` its tensors are copies."""
    state = optimizer.state_dict()
    if snapshot:
        state["state"] = {k: {f: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for f, v in entry.items()}
                          for k, entry in state["state"].items()}
        state["param_groups"] = copy.deepcopy(state["param_groups"])
    return state


def _persistent_buffers(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    found = []
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and name not in module._non_persistent_buffers_set:
            found.append((prefix + name, buf))
    for name, child in module.named_children():
        found += _persistent_buffers(child, prefix + name + ".")
    return found


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """{name not stored separately: name holding the data} for tied parameters."""
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def partitioned_optimizer_state(view: CheckpointView, hp: HpState, rank: int, world: int,
                                later: list | None = None, fields_step: tuple | None = None,
                                stream: bool = False) -> dict:
    """Rank `rank`'s `optimizer_state_dict` in DeepSpeed's ZeRO-1/2 layout (collective under ZeRO);
    `later`: see HpState.recut_fields; `fields_step`: HpState.agreed_fields(), when already known;
    `stream`: NVMe-offloaded state as StreamedTensors where it can (HpState.recut)."""
    described = Description.of(hp.groups, world, zero3=False)   # [Note: a checkpoint describes itself]
    layouts = described.partitions
    fields, step = fields_step if fields_step is not None else hp.agreed_fields(view.dp_group)
    # DeepSpeed stores the fp32 slices without their end padding, the optimizer states with it
    parts = hp.recut(["fp32"] + fields, layouts, rank, strip_padding={"fp32"}, later=later, stream=stream)
    paddings = [layout.padding(rank) for layout in layouts]
    base_state = {}
    for g in range(len(layouts)):
        entry: dict[str, Any] = {}
        if step is not None:
            entry["step"] = torch.tensor(float(step))  # host: checkpoint file
        for field in fields:
            entry[field] = parts[field][g]
        base_state[g] = entry
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [g]}
                    for g, group in enumerate(hp.base.param_groups)]
    from ...utils.tensor_fragment import fragment_address

    slice_mappings = [OrderedDict((hp.groups[g][f.index][0], fragment_address(numel=f.numel, start=f.shard_start))
                                  for f in layout.fragments(rank)) for g, layout in enumerate(layouts)]
    wrapper = hp.wrapper
    state = {
        "loss_scaler": upstream_scaler(wrapper.loss_scaler),
        "dynamic_loss_scale": bool(wrapper.loss_scaler.dynamic),
        "overflow": bool(getattr(wrapper, "overflow", False)),
        "clip_grad": float(view.gradient_clipping),
        "base_optimizer_state": {"state": base_state, "param_groups": param_groups},
        "single_partition_of_fp32_groups": parts["fp32"],
        "group_paddings": paddings,
        "partition_count": [world] * len(layouts),
        "ds_version": __version__,
        "param_slice_mappings": slice_mappings,
        FRAGMENTS_KEY: described.record(rank),
    }
    if view.zero_stage > 0:
        from ..zero.config import ZeroStageEnum

        state["zero_stage"] = ZeroStageEnum(view.zero_stage)
        state["param_alignment_paddings"] = [[0] * len(g) for g in hp.groups]
    return state


def rng_state() -> dict:
    import random

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _universal_info(module: Any, megatron_dims: dict[str, int] | None, mp_world_size: int) -> dict:
    """{"universal_checkpoint_info": the module's (AutoTP's description, affine maps included; upstream's engine
    writes it too), with maps for your Megatron-style layers' slices added}, or {} when there is none. Their
    slice count: a pipeline module's grid's slice size, else (a client mpu) the model-parallel size."""
    from ...checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    info = copy.deepcopy(getattr(module, UNIVERSAL_CHECKPOINT_INFO, None))
    if megatron_dims:
        grid = module.mpu() if callable(getattr(module, "mpu", None)) else None
        tp = grid.get_slice_parallel_world_size() if grid is not None else mp_world_size
        info = _with_megatron_maps(info, module, megatron_dims, tp)
    return {} if info is None else {UNIVERSAL_CHECKPOINT_INFO: info}


def _with_megatron_maps(info: dict | None, module: Any, dims: dict[str, int], tp: int) -> dict:
    """`info` (AutoTP's, or a new one) with an affine map for every parameter of `module` it does not describe
    yet: split on its tagged partition dim over `tp` ranks, else whole on each ([Note: affine maps] in
    checkpoint/affine.py)."""
    import re

    from ...checkpoint.constants import (AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO,
                                         UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    from ...checkpoint.tp_maps import published, recorded_maps, split_map

    info = dict(info or {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})
    maps = recorded_maps({UNIVERSAL_CHECKPOINT_INFO: info})
    for name, p in module.named_parameters():
        pattern = rf"^{re.escape(name)}$"
        if pattern not in maps:
            full = list(getattr(p, "ds_shape", None) or p.shape)   # ZeRO-3: the real shape of a released one
            if name in dims:
                full[dims[name]] *= tp
            maps[pattern] = split_map(full, dims.get(name), None, tp).to_dict()
    info[AFFINE_MAP] = {**published({}), AFFINE_MAP_PARAMS: maps}
    return info


def _tp_partition_dims(module: Any) -> tuple[dict[str, int], dict[str, list[int]]]:
    """{parameter name: the dim AutoTP split it on}, and {name: fused block sizes along it} (both empty
    without tensor-parallel layers)."""
    from ...module_inject.layers import tp_layers

    dims, blocks = {}, {}
    for layer in tp_layers(module):
        for p, dim in layer.sharded_params():
            dims[id(p)] = dim
            if layer._blocks(dim):
                blocks[id(p)] = list(layer._blocks(dim))
    named = list(module.named_parameters())
    return ({n: dims[id(p)] for n, p in named if id(p) in dims},
            {n: blocks[id(p)] for n, p in named if id(p) in blocks})


MEGATRON_TP_DIMS = "tensor_model_parallel_dims"


def _megatron_partition_dims(module: Any) -> dict[str, int | None]:
    """{name: its `partition_dim`} of the parameters your Megatron-style layers tag `tensor_model_parallel`
    (or `model_parallel`; None when the tag has no `partition_dim`, or a `partition_stride` other than 1:
    zero_to_fp32 then refuses to guess how to join the slices)."""
    out = {}
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False):
            dim, stride = getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1)
            out[name] = int(dim) if dim is not None and stride == 1 else None
    return out

