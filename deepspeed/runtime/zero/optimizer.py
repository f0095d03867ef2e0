"""ZeroOptimizer: fp32 master shards and optimizer state partitioned across data-parallel ranks.

One class for stages 1 and 2 (and the optimizer side of stage 3): the stage only changes
when gradients are reduce-scattered (every backward, or only at the boundary; see StageSpec).
Layout: [Note: per-bucket shards] in partition.py. Each rank keeps, per bucket, an fp32 master
slice; the base torch optimizer sees one tensor per parameter fragment (views of that slice),
so its state is exactly this rank's 1/N. Parameters become views of per-bucket flat buffers,
which the step refreshes with one all-gather per bucket.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from ... import comm as ds_comm
from ...utils.timer import OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_STEP_TIMER, timed
from ..base_optimizer import ZeROOptimizer
from ..optimizer_wrapper import OptimizerWrapper, clip_sharded_grads, counted_in_norm  # noqa: F401
from ..precision.policy import PrecisionPolicy
from ..universal_hooks import UniversalCheckpointHooks
from .muon.sharded import ShardedMuon
from .host_buffers import DeviceToHost, host_copy, host_zeros, pinning
from .partition import BucketPartition
from .shard_state_dict import ShardFlatStateDict


def attach_fragment_masters(optimizer: torch.optim.Optimizer, shards: list[Any],
                            names: dict[int, str]) -> tuple[dict[int, list[torch.Tensor]], list[list[Any]]]:
    """Point the base optimizer at this rank's fp32 master fragments instead of model parameters.

    `shards` hold `master`, `grad` (1-D slices), `fragments`, `params` and an empty
    `fragment_masters` list (a _ShardedBucket at stages 1-2, a unit's master at stage 3). Each
    fragment becomes a leaf tensor viewing its master slice, given a view of the gradient slice
    as `.grad` during each step (`point_fragment_grads`), so per-group lr / weight decay apply
    and the optimizer state is exactly this rank's 1/N. Returns ({id(model param): its fragments}, the model
    parameters of each param group, the order checkpoints list them in).
    """
    fragments_of: dict[int, list[torch.Tensor]] = {}
    for shard in shards:
        for f in shard.fragments:
            master = torch.nn.Parameter(shard.master[f.shard_start:f.shard_start + f.numel], requires_grad=False)
            shard.fragment_masters.append((master, f))
            fragments_of.setdefault(id(shard.params[f.index]), []).append(master)
            names[id(master)] = names.get(id(shard.params[f.index]), "?")
    model_param_groups = [list(g["params"]) for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [m for p in group["params"] for m in fragments_of.get(id(p), [])]
    optimizer.state.clear()  # keyed by the model parameters it no longer sees
    return fragments_of, model_param_groups


def point_fragment_grads(shards: list[Any]) -> None:
    """Make each fragment master's `.grad` a view of its shard's gradient tensor, where it does not
    already (stages 1-2 create a fresh gradient shard per step, see `release_fragment_grads`)."""
    for shard in shards:
        grad = shard.grad
        if shard.pointed_grad is not grad:
            for master, f in shard.fragment_masters:
                master.grad = grad[f.shard_start:f.shard_start + f.numel]
            shard.pointed_grad = grad


def release_fragment_grads(shards: list[Any]) -> None:
    """Drop the fragment masters' gradient views after the base optimizer's step, so that the
    reducer's zero_grad really frees the gradient shards."""
    for shard in shards:
        for master, _ in shard.fragment_masters:
            master.grad = None
        shard.pointed_grad = None


def collect_shard_grads(shards: list[Any]) -> list[torch.Tensor]:
    """The master-side gradient slices, copied from where they were reduced when that differs
    (offload or another dtype), with the fragment masters' `.grad` pointing into them. Copies into
    pinned buffers run asynchronously, with one wait before anything reads them
    ([Note: pinned optimizer offload] in host_buffers.py)."""
    copies = DeviceToHost()
    for shard in shards:
        if shard.grad is not shard.grad_source:
            copies.copy(shard.grad, shard.grad_source, shard.pinned)
    copies.wait()
    point_fragment_grads(shards)
    return [shard.grad for shard in shards]


def step_on_shards(wrapper: Any, shards: list[Any], culprit: str, comm_device: torch.device) -> bool:
    """The sharded step both ZeRO optimizers share: collect the gradient slices, skip on overflow,
    clip by the global norm, run the base optimizer. The gradients are consumed after, applied or
    skipped (`wrapper.zero_grad()`), as DeepSpeed's ZeRO step consumes its averaged gradients: a
    client that calls `optimizer.step()` without `engine.step()` (Lightning Fabric does) starts the
    next backward from zero. Returns whether the update was applied."""
    try:
        grads = collect_shard_grads(shards)
        if wrapper.tp_replicated is not None:   # [Note: TP-replicated gradients]
            wrapper.tp_replicated.average([(m.grad, shard.params[f.index], f.param_start)
                                           for shard in shards for m, f in shard.fragment_masters], comm_device)
        wrapper.overflow = wrapper._found_overflow(grads)
        if wrapper.overflow:
            applied = wrapper._skip_step(culprit)
        else:
            if wrapper.clip > 0.0 and wrapper.split is not None:   # per parameter: the fragments
                pieces = [(m.grad, counted_in_norm(shard.params[f.index], wrapper.split))
                          for shard in shards for m, f in shard.fragment_masters if m.grad is not None]
                wrapper._global_grad_norm = clip_sharded_grads([g for g, _ in pieces], wrapper.clip, comm_device,
                                                               wrapper.group, wrapper.dp_world, wrapper.split,
                                                               [c for _, c in pieces])
            elif wrapper.clip > 0.0:
                wrapper._global_grad_norm = clip_sharded_grads(grads, wrapper.clip, comm_device, wrapper.group,
                                                               wrapper.dp_world)
            if wrapper.muon is not None:   # [Note: Muon under ZeRO]: whole-matrix Newton-Schulz
                wrapper.muon.step()
            elif wrapper.swapper is not None:   # [Note: optimizer state swapping] (NVMe offload)
                wrapper.swapper.step()
            else:
                wrapper.optimizer.step()
            applied = True
    finally:
        release_fragment_grads(shards)
    wrapper.zero_grad()
    return applied


class MasterShard:
    """The optimizer side of one shard (a bucket at stages 1-2, a unit at stage 3): the fp32
    `master` slice, the fragment masters the base optimizer steps (views of it) and, with offload
    or another dtype, a master-side copy of the gradient slice (`_master_grad`). The rebinds
    move them (engine.offload_states) without leaving a view on the old storage."""

    master: torch.Tensor
    fragment_masters: list[tuple[torch.Tensor, Any]]
    pointed_grad: torch.Tensor | None
    _master_grad: torch.Tensor | None
    pinned: bool = False   # master and gradient copy in pinned host memory ([Note: pinned optimizer offload])
    published: bool = False   # the step wrote the new master values to the model side already (NVMe offload)

    def resident(self, dirty: bool) -> Any:
        """A context with the master in memory: NVMe offload's swapper replaces this (held in memory
        otherwise: nothing to do)."""
        return contextlib.nullcontext()

    def _make_master(self, source: torch.Tensor, dtype: torch.dtype, device: torch.device, same: bool,
                     pin_memory: bool) -> None:
        """`master` (a copy of `source`) on `device`, and with offload or another dtype a master-side
        gradient copy; both pinned where `pinning` says so (the source is then on the device: the
        host copy of the gradient is always needed)."""
        self.pinned = pinning(pin_memory, source.device, device)
        if self.pinned:
            self.master = host_copy(source, dtype, True)
            self._master_grad = host_zeros(self.master, True)
        else:
            self.master = source.detach().to(device=device, dtype=dtype).clone()
            self._master_grad = None if same else torch.zeros_like(self.master)

    def rebind_master(self, master: torch.Tensor) -> None:
        self.master = master
        for fragment_master, f in self.fragment_masters:
            fragment_master.data = master[f.shard_start:f.shard_start + f.numel]
            fragment_master.grad = None
        self.pointed_grad = None   # the next step points the gradients again

    @property
    def master_grad_copy(self) -> torch.Tensor | None:
        return self._master_grad

    def rebind_master_grad(self, grad: torch.Tensor) -> None:
        self._master_grad = grad
        self.pointed_grad = None


class _ShardedBucket(MasterShard):
    """One bucket's parameter buffer, this rank's master slice and gradient slice.

    The gradient slice is the reducer's shard of the bucket, which exists from the first
    reduction after a step to the next step's zero_grad (DeepSpeed frees its averaged gradients
    after the step too); `grad_source` creates zeros when read in between."""

    def __init__(self, bucket: Any, reducer: Any, rank: int, world: int, master_dtype: torch.dtype,
                 master_device: torch.device, pin_memory: bool = False) -> None:
        self.partition = BucketPartition(tuple(p.numel() for p in bucket.params), world)
        self.group, self.world, self.rank = bucket.group, world, rank
        first = bucket.params[0]
        self.param_flat = torch.zeros(self.partition.padded_numel, dtype=first.dtype, device=first.device)
        for p, start in zip(bucket.params, self.partition.offsets()):
            view = self.param_flat[start:start + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view  # the all-gather after each step writes straight into the parameters
        lo = rank * self.partition.shard_numel
        mine = self.param_flat[lo:lo + self.partition.shard_numel]
        self._bucket, self._reducer = bucket, reducer
        same = first.device == master_device and (reducer.accum_dtype or first.dtype) == master_dtype
        # Offload or another dtype: a master-side gradient copy, filled at each step (collect_shard_grads).
        self._make_master(mine, master_dtype, master_device, same, pin_memory)
        self.params = bucket.params
        self.fragments = self.partition.fragments(rank)
        self.fragment_masters: list[tuple[torch.Tensor, Any]] = []
        self.pointed_grad: torch.Tensor | None = None

    def publish(self) -> None:
        """Cast the updated master into this rank's slice of the parameter buffer, which the
        all-gather then sends ([Note: optimizer state swapping]: the master goes back to disk)."""
        lo = self.rank * self.partition.shard_numel
        self.param_flat[lo:lo + self.partition.shard_numel].copy_(self.master)
        self.published = True

    def gather_source(self) -> torch.Tensor:
        """What this rank sends in the parameter all-gather after a step."""
        if self.published:
            self.published = False
            lo = self.rank * self.partition.shard_numel
            return self.param_flat[lo:lo + self.partition.shard_numel].clone()
        return self.master.to(device=self.param_flat.device, dtype=self.param_flat.dtype)

    def rebind_param_flat(self, flat: torch.Tensor) -> None:
        """Make `flat` the bucket's parameter buffer; the parameters become views of it again."""
        self.param_flat = flat
        for p, start in zip(self.params, self.partition.offsets()):
            p.data = flat[start:start + p.numel()].view_as(p)

    @property
    def grad_source(self) -> torch.Tensor:
        """Where the reducer accumulates this rank's slice."""
        return self._reducer.shard_grad_of(self._bucket)

    @property
    def grad(self) -> torch.Tensor:
        """The gradient slice the base optimizer reads (the source itself unless offloaded)."""
        return self.grad_source if self._master_grad is None else self._master_grad


class PartitionedStateDict:
    """What the ZeRO optimizers (stages 1-3) hand over to their engine, which owns it (a higher layer).

    `state_dict()`, as DeepSpeed's: this rank's partition in the layout of its `*_optim_states.pt`
    file (`optimizer_state_dict` there). Lightning's Trainer calls it on every rank when it builds a
    checkpoint, then drops the result and saves through `engine.save_checkpoint`. Collective here
    (the pieces are re-cut to DeepSpeed's layout), so every rank must call it, as Lightning does.
    `offload_states()` / `reload_states()`: upstream's optimizers have them too, and RLHF code calls
    them there (OpenRLHF: `engine.optimizer.offload_states(...)`, then `engine.reload_states()`)."""

    step_consumes_grads = True   # step() ends with zero_grad() (see step_on_shards); the engine skips its own
    swapper: Any = None   # offload_optimizer nvme: runtime/swap_tensor/optimizer_swapper.py
    # (`_engine` / `_live_engine`: the weak link to the engine, from base_optimizer.EngineOptimizer)

    def state_dict(self) -> dict:
        return self._engine("state_dict")._optimizer_partition_state()

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        self._engine("offload_states").offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self._engine("reload_states").reload_states(non_blocking)

    def _refuse_step_if_offloaded(self) -> None:
        """A client that steps the optimizer itself (Lightning Fabric) meets the engine's guard too
        (a step through the engine was checked there already: this is a dict lookup)."""
        engine = self._live_engine()
        if engine is not None:
            engine._refuse_if_offloaded("step")

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.load_state_dict: load ZeRO optimizer state with "
                                  "engine.load_checkpoint(...) (it re-shards to any world size and stage)")


class ZeroOptimizer(PartitionedStateDict, UniversalCheckpointHooks, OptimizerWrapper, ZeROOptimizer):
    """Wraps the base optimizer so it updates this rank's shard of fp32 master weights."""

    fragment_layout = "buckets"  # read by deepspeed.utils.tensor_fragment

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: Any, policy: PrecisionPolicy, clip: float,
                 names: dict[int, str], group: Any = None, master_device: torch.device | None = None,
                 pin_memory: bool = False):
        master_dtype = policy.master_dtype
        self._init_wrapper(optimizer, policy, clip, names, group)
        self.reducer = reducer
        self._comm_device = reducer.buckets[0].params[0].device if reducer.buckets else \
            ds_comm.collective_device(group)
        device = master_device or self._comm_device
        # each bucket is sharded over the ranks it is reduced over: expert buckets over their
        # expert-data-parallel group ([Note: expert gradients] in engine_moe.py), the rest over `group`
        self.buckets = [_ShardedBucket(b, reducer, b.rank, b.world, master_dtype, device, pin_memory)
                        for b in reducer.buckets]
        self._fragments_of, self.model_param_groups = attach_fragment_masters(optimizer, self.buckets, names)
        self.muon = ShardedMuon.maybe(optimizer, self.buckets, [[p.shape for p in sb.params] for sb in self.buckets],
                                      self.model_param_groups, group, self._comm_device, names)
        if self.muon is None:   # [Note: the base optimizer's state_dict at ZeRO-1/2]
            me = weakref.ref(self)
            ShardFlatStateDict(optimizer, self.buckets, self.model_param_groups,
                               lambda: (w := me()) is not None and w.swapper is None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grad()

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards, one per gradient bucket (upstream: one per param group),
        the tensors the step updates (upstream's attribute name)."""
        return [sb.master for sb in self.buckets]

    def shard_numel(self) -> int:
        """Master elements held by this rank (ceil(bucket/N) per bucket, padding included)."""
        return sum(sb.master.numel() for sb in self.buckets)

    # --- the step ---------------------------------------------------------------------------
    def step(self, closure: Any = None) -> bool:
        self._refuse_step_if_offloaded()
        with timed(self, OPTIMIZER_STEP_TIMER):   # wall_clock_breakdown (engine observer)
            applied = step_on_shards(self, self.buckets, "a gradient shard", self._comm_device)
        if not applied:
            return False
        with timed(self, OPTIMIZER_ALLGATHER_TIMER):
            self._all_gather_params()
        self.loss_scaler.update_scale(False)
        return True

    def _all_gather_params(self) -> None:
        works = []
        for sb in self.buckets:
            shard = sb.gather_source()
            if sb.world > 1:
                works.append(ds_comm.all_gather_into_tensor(sb.param_flat, shard, group=sb.group, async_op=True))
            else:
                sb.param_flat.copy_(shard)
        for work in works:
            work.wait()

    def __repr__(self) -> str:
        return f"ZeroOptimizer({type(self.optimizer).__name__}, buckets={len(self.buckets)}, world={self.dp_world})"
