"""Upstream's ZeRO-3 parameter attributes, published on each partitioned parameter for downstream
readers (Hugging Face transformers and accelerate, Lightning, upstream's own tests). The runtime
never reads them back: it asks the gather unit (sharded_param.py) or the zero.Init registry
(init_context.py), which call `publish` whenever something changes.

    ds_id          a process-wide id
    ds_shape       the full shape (`.shape` reads torch.Size([0]) while released)
    ds_numel       the full number of elements
    ds_persist     the parameter stays gathered (its unit is persistent)
    ds_status      ZeroParamStatus: AVAILABLE (gathered), NOT_AVAILABLE, INFLIGHT (prefetching)
    ds_tensor      this rank's partition of the parameter: elements [r*s, (r+1)*s) of the
                   flattened parameter, s = ceil(ds_numel / N), the last ranks' padded with zeros;
                   writes to it are what the next gather shows. Carries `ds_numel` (= s),
                   `status` (PartitionedParamStatus.AVAILABLE) and `final_location` (None: no NVMe)
    ds_numel_aligned  N*s
    ds_active_sub_modules  an empty set (upstream's per-call bookkeeping; RL libraries clear it)
    partition_numel()  s;  padding_size()  N*s - ds_numel;  aligned_size()  N*s
    all_gather_coalesced(params)  gathers the units of `params` (a collective; see the function)
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import torch


class ZeroParamStatus(enum.Enum):
    """Upstream's parameter status (deepspeed.runtime.zero.partition_parameters.ZeroParamStatus)."""

    AVAILABLE = 1       # gathered: `.data` is the full parameter
    NOT_AVAILABLE = 2   # released: only this rank's shard exists
    INFLIGHT = 3        # a prefetch (asynchronous all-gather) is running; see prefetch.py


class PartitionedParamStatus(enum.Enum):
    """Upstream's `ds_tensor.status` (deepspeed.runtime.swap_tensor): always AVAILABLE here."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_DS_IDS = itertools.count()


def next_ds_id() -> int:
    return next(_DS_IDS)


class _Constant:
    """A zero-argument callable returning a fixed size (`param.partition_numel()` and friends):
    no reference to the parameter, so copies and pickles of it stay correct and acyclic."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value

    def __reduce__(self) -> tuple:
        return (_Constant, (self.value,))

    def __repr__(self) -> str:
        return f"<ZeRO-3 size {self.value}>"


def publish(param: Any, *, ds_id: int, shape: torch.Size, persist: bool, tensor: torch.Tensor, world: int,
            status: ZeroParamStatus) -> None:
    """Set every upstream attribute of `param`; `tensor` is this rank's partition (ceil(numel/world)
    elements)."""
    numel = shape.numel()
    size = -(-numel // world)
    param.ds_id, param.ds_shape, param.ds_numel, param.ds_persist = ds_id, shape, numel, persist
    param.ds_numel_aligned = size * world
    tensor.ds_numel, tensor.status, tensor.final_location = size, PartitionedParamStatus.AVAILABLE, None
    param.ds_tensor = tensor
    param.ds_status = status
    if "ds_active_sub_modules" not in param.__dict__:   # read (and cleared) by RL libraries; never filled
        param.ds_active_sub_modules = set()
    if "is_external_param" not in param.__dict__:       # set by units.add_external_parameter
        param.is_external_param = False
    param.all_gather_coalesced = all_gather_coalesced
    param.partition_numel = _Constant(size)
    param.padding_size = _Constant(size * world - numel)
    param.aligned_size = _Constant(size * world)


NAMES = ("ds_id", "ds_shape", "ds_numel", "ds_persist", "ds_numel_aligned", "ds_tensor", "ds_status",
         "partition_numel", "padding_size", "aligned_size", "ds_active_sub_modules", "all_gather_coalesced")


class _Gathered:
    """The handle upstream's all_gather_coalesced returns: the gathers here complete before it does."""

    def wait(self) -> None:
        return None


def all_gather_coalesced(params: Any, safe_mode: bool = False, quantize: bool = False) -> _Gathered:
    """Upstream's `param.all_gather_coalesced(params)`: the units holding `params` gathered (one
    all-gather per unit, in the order given: every rank calls it with the same list). They stay
    gathered until their next forward use ends, `engine.empty_partition_cache()` or the next optimizer
    step releases them (upstream frees them at the step too). `quantize`: a qwZ (int8) gather is
    allowed; else the values are the shards' exactly. A function, not a method: nothing references
    the parameter it is published on (see _Constant)."""
    units = list(dict.fromkeys(unit_of(p) for p in params))
    if None in units:
        raise RuntimeError("all_gather_coalesced: a parameter is not partitioned by a ZeRO-3 engine (before "
                           "deepspeed.initialize, gather zero.Init parameters with deepspeed.zero.GatheredParameters)")
    for unit in units:
        unit.gather(exact=not quantize)
    return _Gathered()


def unpublish(param: Any) -> None:
    for name in NAMES:
        param.__dict__.pop(name, None)


OWNER_ATTR = "_ds_zero3_owner"   # a ZeRO-3 parameter's link to its ShardedUnit (sharded_param._Owner)


def unit_of(param: Any) -> Any:
    """The ShardedUnit that holds `param` (None for a parameter no ZeRO-3 engine partitions)."""
    owner = getattr(param, OWNER_ATTR, None) if isinstance(param, torch.nn.Parameter) else None
    return owner.unit if owner is not None else None
