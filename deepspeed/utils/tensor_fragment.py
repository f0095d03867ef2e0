# compat: upstream deepspeed.utils.tensor_fragment: the `safe_*` accessors for a model
# parameter's fp32 master weights, gradient and optimizer state (DeepSpeed 0.19.8 names).
"""Reading and writing the training state of one model parameter, wherever it lives.

[Note: parameter links]
Upstream attaches a mapping object to every parameter. Here parameters stay untouched: the
engine registers each wrapped optimizer (`register_optimizer`), which records, per model
parameter, where its state lives, in a weak-keyed table:

* ZeRO stages 1/2 (`ZeroOptimizer`): the parameter's bucket and position. This rank holds at
  most one contiguous fragment of it (see [Note: per-bucket shards] in zero/partition.py):
  the fp32 master slice `bucket.master[f.shard_start:...]`, the reduced gradient slice of
  `bucket.grad_source`, and optimizer state keyed by the fragment tensor in `_fragments_of`.
  The `full` getters are collective over the data-parallel group: each rank writes its
  fragment into a zero buffer of the parameter's size and one all-reduce (SUM) assembles it;
  fragments are disjoint, so the sum is exact.
* ZeRO stage 3 (`Stage3Optimizer`): the same, with the optimizer's per-unit masters
  (`optimizer.units`, same attributes as a bucket) in place of buckets: a unit is split with
  the same BucketPartition, so a parameter again has at most one fragment per rank. Only
  trainable parameters are linked (a frozen one in a trained unit gives None), and the full
  shape comes from the unit (`unit.shapes`), the model parameter being a released placeholder.
  Setting the full fp32 value also writes this rank's fragment into `unit.shard` (the model
  side) and, where the unit is gathered (persistent, or inside a forward), its visible values:
  every rank holds the full value, so nothing communicates.
* Stage 0 mixed precision (`MixedPrecisionOptimizer`): the fp32 master; the gradient is the
  reducer's bucket view. Stage 0 fp32 (bare torch optimizer): the parameter itself.
  Everything is replicated, so nothing communicates.

A parameter no optimizer was registered for (frozen, or not trained by an engine) gives None,
as upstream does for parameters without a mapping.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from deepspeed import comm as ds_comm

_LOCAL_ONLY = "This API is only defined for ZeRO-partitioned parameters (zero_optimization.stage 1, 2 or 3)"


@dataclass
class fragment_address:
    """Where a parameter's piece lies in a rank's flat partition (upstream name; ZeRO checkpoints
    pickle it in `param_slice_mappings`, so it must exist at this import path)."""

    numel: int
    start: int


@dataclass(frozen=True)
class _Link:
    optimizer: weakref.ref                  # Zero/Stage3/MixedPrecisionOptimizer or a torch optimizer
    bucket: int = -1                        # ZeRO: index into _shards(optimizer) (-1: not sharded)
    index: int = -1                         # ZeRO: position of the parameter in that bucket
    master: Optional[weakref.ref] = None    # stage 0 mixed precision: the fp32 master tensor

    @property
    def sharded(self) -> bool:
        return self.bucket >= 0


_LINKS: Any = WeakIdKeyDictionary()  # model parameter -> _Link; see [Note: parameter links]


# Which layout an engine optimizer keeps its state in: a class attribute of the runtime's
# optimizers (this low layer never imports them). "buckets": ZeRO-1/2, "units": ZeRO-3,
# "masters": stage-0 mixed precision; anything else is a bare torch optimizer.
def _layout(optimizer: Any) -> Optional[str]:
    return getattr(type(optimizer), "fragment_layout", None)


def _is_zero(optimizer: Any) -> bool:
    return _layout(optimizer) in ("buckets", "units")


def _shards(optimizer: Any) -> list[Any]:
    """A ZeRO optimizer's shards: buckets (stages 1/2) or unit masters (stage 3), each with
    `master`, `grad_source`, `fragments` (this rank's) and `params`."""
    return optimizer.units if _layout(optimizer) == "units" else optimizer.buckets


def _zero_links(optimizer: Any) -> Any:
    """(shard index, position, parameter) of every parameter a ZeRO optimizer trains. Bucket
    parameters all are; in a stage-3 unit only the trainable ones (frozen ones give None)."""
    for b, sb in enumerate(_shards(optimizer)):
        unit = getattr(sb, "unit", None)
        for i in (unit.trainable if unit is not None else range(len(sb.params))):
            yield b, i, sb.params[i]


def _is_mixed(optimizer: Any) -> bool:
    return _layout(optimizer) == "masters"


def register_optimizer(optimizer: Any) -> Any:
    """Link every parameter `optimizer` trains to it (called by the engine); returns `optimizer`."""
    if optimizer is None:
        return None
    ref = weakref.ref(optimizer)
    if _is_zero(optimizer):
        for b, i, p in _zero_links(optimizer):
            _LINKS[p] = _Link(ref, b, i)
    elif _is_mixed(optimizer):
        masters = {id(p): m for p, m in optimizer._pairs}
        for p in optimizer.grads.params():
            m = masters.get(id(p))
            _LINKS[p] = _Link(ref, master=weakref.ref(m) if m is not None else None)
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                _LINKS[p] = _Link(ref)
    return optimizer


def register_param_owner(param: torch.nn.Parameter, optimizer: Any) -> None:
    """Link one model parameter to the (engine-wrapped) optimizer that trains it."""
    ref = weakref.ref(optimizer)
    if _is_zero(optimizer):
        for b, i, p in _zero_links(optimizer):
            if p is param:
                _LINKS[param] = _Link(ref, b, i)
                return
        raise ValueError("register_param_owner: the ZeRO optimizer does not own this parameter")
    if _is_mixed(optimizer):
        master = next((m for p, m in optimizer._pairs if p is param), None)
        _LINKS[param] = _Link(ref, master=weakref.ref(master) if master is not None else None)
        return
    _LINKS[param] = _Link(ref)


def _lookup(param: torch.Tensor) -> tuple[Optional[_Link], Any]:
    link = _LINKS.get(param)
    optimizer = link.optimizer() if link is not None else None
    return (link, optimizer) if optimizer is not None else (None, None)


# --- ZeRO stages 1-3 ----------------------------------------------------------------------
def _fragment(link: _Link, optimizer: Any) -> tuple[Any, Any]:
    """(bucket or unit master, this rank's Fragment of the parameter or None)."""
    sb = _shards(optimizer)[link.bucket]
    return sb, next((f for f in sb.fragments if f.index == link.index), None)


def _full_shape(sb: Any, link: _Link, param: torch.Tensor) -> torch.Size:
    """The parameter's full shape: from the unit at stage 3 (`param` is released there)."""
    unit = getattr(sb, "unit", None)
    return unit.shapes[link.index] if unit is not None else param.shape


def _state_key(param: torch.Tensor, optimizer: Any) -> torch.Tensor:
    """The fragment tensor the base optimizer's state is keyed by (one per rank at most)."""
    return optimizer._fragments_of[id(param)][0]


def _local_state(param: torch.Tensor, optimizer: Any, key: str) -> Optional[torch.Tensor]:
    """This rank's `key` state of the parameter's fragment, None where the base optimizer has none."""
    fragment = _state_key(param, optimizer)
    value = optimizer.state.get(fragment, {}).get(key)
    return value if torch.is_tensor(value) and value.shape == fragment.shape else None


def _assemble(shape: torch.Size, device: torch.device, optimizer: Any, sb: Any, frag: Any,
              piece: Optional[torch.Tensor], key: Optional[str] = None) -> torch.Tensor:
    """Collective: the full fp32 tensor from every rank's fragment, with one all-reduce.

    For optimizer state (`key` given) one more element carries "some rank holds a fragment
    but no such state", so that every rank raises alike instead of leaving the others waiting
    in the collective.
    """
    numel = shape.numel()
    buffer = torch.zeros(numel + (key is not None), dtype=torch.float32, device=device)
    if frag is not None and piece is not None:
        buffer[frag.param_start:frag.param_start + frag.numel].copy_(piece.reshape(-1))
    if key is not None and frag is not None and piece is None:
        buffer[numel] = 1.0
    # over the ranks the shard is partitioned across: an expert bucket's expert-data-parallel group
    if getattr(sb, "world", optimizer.dp_world) > 1:
        ds_comm.all_reduce(buffer, group=getattr(sb, "group", optimizer.group))
    if key is not None and buffer[numel].item() > 0:
        raise _missing_key(key)
    return buffer[:numel].reshape(shape)


def _slice(value: torch.Tensor, shape: torch.Size, frag: Any) -> torch.Tensor:
    if value.numel() != shape.numel():
        raise ValueError(f"value has {value.numel()} elements, the parameter {shape.numel()}")
    return value.reshape(-1)[frag.param_start:frag.param_start + frag.numel]


def _check_local(value: torch.Tensor, target: torch.Tensor) -> None:
    if value.numel() != target.numel():
        raise ValueError(f"value has {value.numel()} elements, this rank's partition {target.numel()}")


# --- stage 0 --------------------------------------------------------------------------------
def _master(link: _Link, param: torch.Tensor) -> torch.Tensor:
    """Stage 0: the tensor the optimizer updates (fp32 master, or the parameter itself)."""
    master = link.master() if link.master is not None else None
    return master if master is not None else param


def _replicated_grad(link: _Link, optimizer: Any, param: torch.Tensor) -> Optional[torch.Tensor]:
    """Stage 0: the averaged gradient buffer (bucket view under mixed precision) or param.grad."""
    if param.grad is not None:
        return param.grad
    if _is_mixed(optimizer):
        return optimizer.grads.grad_view(param)
    return None


def _copy(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A detached copy: what the helpers hand out must not alias buffers a later step reuses."""
    return tensor.detach().clone() if tensor is not None else None


def _missing_key(key: str) -> ValueError:
    return ValueError(f"{key} not found in optimizer state fragment")


def _swapped_in(dirty: bool) -> Callable:
    """With NVMe offload, the parameter's shard is read in around the call (and written back if
    `dirty`): [Note: optimizer state swapping] in runtime/swap_tensor/optimizer_swapper.py."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> Any:
            link, optimizer = _lookup(param)
            swapper = getattr(optimizer, "swapper", None)
            if swapper is None or not link.sharded:
                return fn(param, *args, **kwargs)
            with swapper.shard_resident(link.bucket, dirty):
                return fn(param, *args, **kwargs)
        return inner
    return wrap


# --- full API ---------------------------------------------------------------------------------
@_swapped_in(dirty=False)
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The parameter's fp32 master weights, full shape, as a new tensor (collective under ZeRO:
    every data-parallel rank must call it). None for a parameter no engine optimizer trains."""
    link, optimizer = _lookup(param)
    if link is None:
        return None
    if link.sharded:
        sb, frag = _fragment(link, optimizer)
        piece = sb.master[frag.shard_start:frag.shard_start + frag.numel] if frag is not None else None
        return _assemble(_full_shape(sb, link, param), param.device, optimizer, sb, frag, piece)
    return _master(link, param).detach().to(dtype=torch.float32, copy=True).reshape(param.shape)


@_swapped_in(dirty=True)
def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master weights (and its visible weights) to `value` (full shape).

    Every rank passes the same full value; nothing communicates. The model parameter is
    updated at once on every rank (upstream refreshes it only at the next step's all-gather);
    at stage 3 through this rank's shard, and the visible values where the unit is gathered.
    """
    link, optimizer = _lookup(param)
    if link is None:
        return
    sb, frag = _fragment(link, optimizer) if link.sharded else (None, None)
    shape = _full_shape(sb, link, param) if link.sharded else param.shape
    if value.numel() != shape.numel():
        raise ValueError(f"value has {value.numel()} elements, the parameter {shape.numel()}")
    with torch.no_grad():
        if link.sharded:
            piece = _slice(value, shape, frag) if frag is not None else None
            if piece is not None:
                sb.master[frag.shard_start:frag.shard_start + frag.numel].copy_(piece)
            unit = getattr(sb, "unit", None)
            if unit is not None:  # stage 3: the model side is the unit's shard
                if piece is not None:
                    unit.shard[frag.shard_start:frag.shard_start + frag.numel].copy_(piece)
                unit.shard_changed()   # every rank: hpZ's secondary copies are re-made alike
                if not unit.available:  # released: its next gather reads the shard
                    return
        else:
            master = _master(link, param)
            if master is not param:
                master.data.copy_(value.reshape(master.shape))
        param.data.copy_(value.reshape(param.shape))


@_swapped_in(dirty=False)
def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The fp32 optimizer state `optim_state_key` (e.g. "exp_avg") of the parameter, full shape,
    as a new tensor (collective under ZeRO). ValueError, on every rank, where the base optimizer
    keeps no such per-element state (before the first step, or a scalar such as "step")."""
    link, optimizer = _lookup(param)
    if link is None:
        return None
    if link.sharded:
        sb, frag = _fragment(link, optimizer)
        piece = _local_state(param, optimizer, optim_state_key) if frag is not None else None
        return _assemble(_full_shape(sb, link, param), param.device, optimizer, sb, frag, piece, key=optim_state_key)
    master = _master(link, param)
    value = optimizer.state.get(master, {}).get(optim_state_key)
    if not torch.is_tensor(value) or value.shape != master.shape:
        raise _missing_key(optim_state_key)
    return value.detach().to(dtype=torch.float32, copy=True).reshape(param.shape)


@_swapped_in(dirty=True)
def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state `optim_state_key` of the parameter from a full-shape `value`."""
    link, optimizer = _lookup(param)
    if link is None:
        return
    with torch.no_grad():
        if link.sharded:
            sb, frag = _fragment(link, optimizer)
            if frag is None:
                return
            state = _local_state(param, optimizer, optim_state_key)
            if state is None:
                raise _missing_key(optim_state_key)
            state.copy_(_slice(value, _full_shape(sb, link, param), frag).reshape(state.shape))
            return
        master = _master(link, param)
        state = optimizer.state.get(master, {}).get(optim_state_key)
        if not torch.is_tensor(state) or state.shape != master.shape:
            raise _missing_key(optim_state_key)
        if value.numel() != state.numel():
            raise ValueError(f"value has {value.numel()} elements, the parameter {param.numel()}")
        state.copy_(value.reshape(state.shape))


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The averaged gradient the optimizer will use, full shape (collective under ZeRO).

    Meaningful between the backward of an accumulation boundary and `engine.step()`. Still
    multiplied by the loss scale under fp16, as upstream. Always a new tensor that no later
    engine call changes (upstream hands out `param.grad` itself at stage 0; ours is a view of
    the gradient bucket, which the step zeroes in place): fp32 under ZeRO (stage 3 included:
    the unit's reduced gradient shard) and from a mixed-precision bucket, else `param.grad`'s
    dtype. None for a parameter without gradient.
    """
    link, optimizer = _lookup(param)
    if link is None:
        return _copy(param.grad)
    if link.sharded:
        sb, frag = _fragment(link, optimizer)
        piece = sb.grad_source[frag.shard_start:frag.shard_start + frag.numel] if frag is not None else None
        return _assemble(_full_shape(sb, link, param), param.device, optimizer, sb, frag, piece)
    if param.grad is not None:
        return _copy(param.grad)
    grad = _replicated_grad(link, optimizer, param)
    return grad.detach().to(dtype=torch.float32, copy=True) if grad is not None else None


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the parameter's averaged gradient (full shape; before `engine.step()`)."""
    link, optimizer = _lookup(param)
    with torch.no_grad():
        if link is not None and link.sharded:
            sb, frag = _fragment(link, optimizer)
            if frag is not None:
                sb.grad_source[frag.shard_start:frag.shard_start + frag.numel].copy_(
                    _slice(value, _full_shape(sb, link, param), frag))
            return
        grad = param.grad if link is None else _replicated_grad(link, optimizer, param)
        if grad is not None:
            grad.copy_(value.reshape(grad.shape))


def safe_update_full_grad_vectorized(param_list: List[torch.nn.Parameter], update_func: Callable) -> None:
    """For each parameter: gradient <- update_func(current full gradient, param). Collective under
    ZeRO: every rank passes the same parameters in the same order."""
    for p in param_list:
        link, _ = _lookup(p)
        if link is None and p.grad is None:
            continue
        current = safe_get_full_grad(p)
        if current is not None:
            safe_set_full_grad(p, update_func(current, p))


# --- local API (this rank's partition, flat) --------------------------------------------------
def _local(param: torch.Tensor, frozen_ok: bool = False) -> Optional[tuple[_Link, Any, Any, Any]]:
    """(link, optimizer, bucket or unit master, this rank's Fragment). With `frozen_ok` (the
    getters): None for a frozen parameter or a ZeRO-3 one no engine optimizer trains, as the full
    getters answer (upstream's answer for frozen ZeRO-3 parameters)."""
    link, optimizer = _lookup(param)
    if link is None and frozen_ok and (not param.requires_grad or hasattr(param, "ds_id")):
        return None
    if link is None or not link.sharded:
        raise AssertionError(_LOCAL_ONLY)
    sb, frag = _fragment(link, optimizer)
    return link, optimizer, sb, frag


def _get_local(param: torch.nn.Parameter, empty_dtype: Callable[[Any], torch.dtype],
               read: Callable[[Any, Any, Any], torch.Tensor]) -> Optional[torch.Tensor]:
    """The safe_get_local_* opening: None for a frozen parameter, an empty tensor of
    `empty_dtype(shard)` where this rank holds none of it, else `read(optimizer, shard, fragment)`."""
    local = _local(param, frozen_ok=True)
    if local is None:
        return None
    _, optimizer, sb, frag = local
    if frag is None:
        return torch.empty(0, dtype=empty_dtype(sb), device=param.device)
    return read(optimizer, sb, frag)


def _set_local_slice(param: torch.nn.Parameter, value: torch.Tensor, flat_of: Callable[[Any], torch.Tensor]) -> None:
    """Overwrite this rank's slice of `flat_of(shard)` (nothing where it holds none; shapes checked)."""
    _, _, sb, frag = _local(param)
    flat = flat_of(sb)
    target = flat[frag.shard_start:frag.shard_start + frag.numel] if frag is not None else flat[:0]
    _check_local(value, target)
    with torch.no_grad():
        target.copy_(value.reshape(-1))


@_swapped_in(dirty=False)
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of the fp32 master weights: a flat copy (empty where this rank holds none
    of the parameter; later steps do not change it; None for a frozen one). Concatenating every
    rank's part in rank order gives the flattened full parameter."""
    return _get_local(param, lambda sb: sb.master.dtype, lambda _, sb, frag: sb.master[
        frag.shard_start:frag.shard_start + frag.numel].to(param.device, copy=True))


@_swapped_in(dirty=True)
def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's part of the fp32 master weights; the model parameter follows at the
    next step's all-gather (as upstream)."""
    _set_local_slice(param, value, lambda sb: sb.master)


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of the averaged gradient, flat, in fp32 (a copy)."""
    return _get_local(param, lambda sb: torch.float32, lambda _, sb, frag: sb.grad_source[
        frag.shard_start:frag.shard_start + frag.numel].to(device=param.device, dtype=torch.float32, copy=True))


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's part of the averaged gradient (before `engine.step()`)."""
    _set_local_slice(param, value, lambda sb: sb.grad_source)


@_swapped_in(dirty=False)
def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's part of the optimizer state `optim_state_key`, flat, a copy (KeyError if the
    base optimizer keeps no such state, as upstream)."""
    def read(optimizer: Any, sb: Any, frag: Any) -> torch.Tensor:
        state = _local_state(param, optimizer, optim_state_key)
        if state is None:
            raise KeyError(optim_state_key)
        return state.reshape(-1).to(param.device, copy=True)

    return _get_local(param, lambda sb: sb.master.dtype, read)


@_swapped_in(dirty=True)
def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's part of the optimizer state `optim_state_key`."""
    _, optimizer, sb, frag = _local(param)
    if frag is None:
        _check_local(value, sb.master[:0])
        return
    state = _local_state(param, optimizer, optim_state_key)
    if state is None:
        raise KeyError(optim_state_key)
    _check_local(value, state)
    with torch.no_grad():
        state.copy_(value.reshape(state.shape))
