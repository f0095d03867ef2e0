"""Gradient buffers in buckets and their data-parallel averaging, overlapped with backward.

The reducer owns where gradients live between backward and step. In "bound" mode (stage 0,
accumulation dtype = the parameters' dtype, e.g. fp32 training) `param.grad` is a view of a
bucket. In "detached" mode (mixed precision: bf16/fp16 params, fp32 accumulation; and ZeRO-1/2,
whose buckets are transient) every backward's gradient is added into the bucket and
`param.grad` is freed; the optimizer reads the buckets (or, sharded, the shards) instead.

[Note: gradients as bucket views]
Every trainable parameter's `.grad` is a view into one flat buffer per bucket, so a bucket is
reduced in place with one collective and no copy. Autograd accumulates into an existing
`.grad` in place, so gradient accumulation across micro-steps also lands in the buffer. When
user code replaces `.grad` (for example `optimizer.zero_grad(set_to_none=True)`), the
post-accumulate hook copies the new gradient into its view and re-binds `.grad`.

[Note: bucket launch order]
Asynchronous collectives must be issued in the same order on every rank. Buckets are
therefore launched strictly in index order (bucket k only after buckets < k), like DDP; a
bucket becomes ready when each of its parameters reported a gradient, and `finish()`
launches whatever is left (parameters that got no gradient on this rank contribute zeros,
as DeepSpeed's stage 0 does), so ranks whose graphs differ still issue identical sequences.

[Note: in-place reduce-scatter]
A sharded bucket is reduce-scattered into its own slice: the output is this rank's chunk of
the input (the aliasing NCCL documents as in-place; on gloo, deepspeed.comm's exchange has read
the whole input before its sum writes the chunk), so a reduction allocates no shard-sized
output. `_complete` adds that slice into `shard_grad` (the first reduction after zero_grad
copies it) before the buffer is dropped. Upstream DeepSpeed's stage-3
`reduce_scatter_coalesced` reduces into the input's own chunk the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import comm as ds_comm
from ..utils.weak_hooks import remove_when_collected, weak_hook


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are combined across ranks: DeepSpeed's prescale/predivide semantics and
    `gradient_allreduce_op` ("mean": the average, "sum": the sum; the split between the scaling
    before and after the collective only moves where the division happens)."""

    world_size: int
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    op: str = "mean"

    def before(self) -> float:
        if self.prescale_gradients:
            return 1.0 / self.world_size if self.op == "mean" else 1.0
        return 1.0 / self.gradient_predivide_factor

    def after(self) -> float:
        if self.prescale_gradients:
            return 1.0
        total = 1.0 / self.world_size if self.op == "mean" else 1.0
        return self.gradient_predivide_factor * total


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor                      # 1D, dtype of the parameters
    views: list[torch.Tensor]               # ND views of `flat`, one per param
    comm_dtype: torch.dtype
    pending: set[int] = field(default_factory=set)
    work: Any = None
    comm_buffer: torch.Tensor | None = None
    numel: int = 0                          # unpadded; flat may be padded to a multiple of N
    shard_numel: int = 0                    # sharded mode: padded numel / N
    shard_grad: torch.Tensor | None = None  # sharded mode: this rank's reduced slice, accumulated;
                                            # None until the first reduction after zero_grad()
    group: Any = None                       # the ranks it is reduced (and sharded) over
    world: int = 1
    rank: int = 0


@dataclass(frozen=True)
class CommGroup:
    """Where a parameter's gradient is reduced when that is not the reducer's own group: an expert
    parameter's expert-data-parallel group ([Note: expert gradients] in engine_moe.py). `name`
    keeps such parameters in buckets of their own; the average still divides by the policy's
    world size, so only the collective's ranks (and, sharded, the shard count) change."""

    name: str
    group: Any
    world: int
    rank: int


def plan_buckets(numels: list[int], bucket_numel: int, first_bucket_numel: int | None = None) -> list[list[int]]:
    """Group parameter indices (already in reduction order) into buckets of about `bucket_numel`.

    A parameter larger than a bucket gets a bucket of its own. The first bucket may be smaller
    so that communication starts early in backward (DDP does the same).
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    cap = first_bucket_numel or bucket_numel
    for index, numel in enumerate(numels):
        if current and size + numel > cap:
            buckets.append(current)
            current, size, cap = [], 0, bucket_numel
        current.append(index)
        size += numel
    if current:
        buckets.append(current)
    return buckets


class GradBucketReducer:
    """Owns the gradient buffers of a replicated model and averages them across ranks."""

    def __init__(self, params: list[torch.nn.Parameter], policy: ReducePolicy, bucket_numel: int,
                 comm_dtype_of: Callable[[torch.nn.Parameter], torch.dtype], group: Any = None,
                 first_bucket_numel: int | None = None, accum_dtype: torch.dtype | None = None,
                 shard: bool = False, overlap: bool = True, solo: frozenset[int] = frozenset(),
                 comm_groups: dict[int, CommGroup] | None = None) -> None:
        # Reverse registration order approximates the order gradients become ready.
        ordered = [p for p in reversed(params) if p.requires_grad]
        self.policy = policy
        self.group = group
        self.reduces = policy.world_size > 1
        self.rank = ds_comm.get_rank(group) if self.reduces else 0
        self._own = CommGroup("", group, policy.world_size, self.rank)
        self._comm_groups = comm_groups or {}
        self.accum_dtype = accum_dtype
        # Sharded (ZeRO): reduce-scatter into shard_grad; see [Note: per-bucket shards] in zero/partition.py.
        # Sharded buckets are transient: a bucket's full-size buffer exists only from its first
        # gradient until its reduce-scatter completes (every backward at stage 2, the boundary at
        # stage 1), so between optimizer steps only the shards remain (and not even those: zero_grad).
        self.shard = shard
        # overlap_comm (sharded): a bucket's reduce-scatter runs while the next bucket fills (two
        # full buckets alive); without it each one completes at launch (one alive, as upstream's
        # overlap_comm=false, its stage 1/2 default).
        self.overlap = overlap
        self.peak_live_numel = 0
        self.seen: set[int] = set()  # ids of parameters that received a gradient since zero_grad()
        self.names: dict[int, str] = {}
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, position)
        groups = plan_buckets([p.numel() for p in ordered], bucket_numel, first_bucket_numel)
        if solo:   # parameters that need a bucket of their own (pipeline: tied weights, see reduced_grad)
            groups = [part for g in groups for part in
                      [[i] for i in g if id(ordered[i]) in solo] + [[i for i in g if id(ordered[i]) not in solo]]
                      if part]
        for indices in groups:
            self._add_buckets([ordered[i] for i in indices], comm_dtype_of)
        self._next_launch = 0
        self._armed = False
        # Weakly held: see [Note: tensor hooks and dropped engines] in utils/weak_hooks.py.
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready)) for p in ordered]
        remove_when_collected(self, self._hooks)

    def _add_buckets(self, params: list[torch.nn.Parameter], comm_dtype_of: Callable) -> None:
        """One bucket per (dtype, device, comm dtype) run inside a planned group."""
        by_key: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in params:
            comm = self._comm_groups.get(id(p), self._own)
            by_key.setdefault((p.dtype, p.device, comm_dtype_of(p), comm), []).append(p)
        for (dtype, device, comm_dtype, comm), members in by_key.items():
            world = comm.world
            numel = sum(p.numel() for p in members)
            padded = -(-numel // world) * world if self.shard else numel
            accum = self.accum_dtype or dtype
            # Sharded (transient) buffers are created by the first gradient (`_allocate`), not here.
            flat = None if self.shard else torch.zeros(padded, dtype=accum, device=device)
            views, offset = [], 0
            for position, p in enumerate(members):
                if flat is not None:
                    views.append(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
                self._where[id(p)] = (len(self.buckets), position)
                p.grad = views[-1] if flat is not None and self._bound(flat, p) else None
            self.buckets.append(_Bucket(members, flat, views, comm_dtype, numel=numel,
                                        shard_numel=padded // world if self.shard else 0,
                                        group=comm.group, world=world, rank=comm.rank))

    def _allocate(self, bucket: _Bucket) -> None:
        """(Re)create a transient bucket's full-size buffer and the parameter views into it."""
        first = bucket.params[0]
        padded = bucket.shard_numel * bucket.world
        bucket.flat = torch.zeros(padded, dtype=self.accum_dtype or first.dtype, device=first.device)
        bucket.views, offset = [], 0
        for p in bucket.params:
            bucket.views.append(bucket.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.peak_live_numel = max(self.peak_live_numel, self.live_buffer_numel())

    def _bound(self, flat: torch.Tensor, param: torch.nn.Parameter) -> bool:
        """Whether `param.grad` is a view of the bucket (else gradients are added in and freed).

        Bound saves a gradient allocation per parameter and backward; transient buckets (ZeRO-1/2)
        cannot be bound, and neither can buckets in another dtype (mixed precision).
        """
        return not self.shard and flat.dtype == param.dtype

    # --- backward-time -----------------------------------------------------------------
    def arm(self) -> None:
        """Reduce during the coming backward (called at accumulation boundaries only)."""
        if self._armed:
            return
        self._armed = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = set(range(len(bucket.params)))

    @property
    def armed(self) -> bool:
        return self._armed

    def _bind(self, bucket: _Bucket, position: int) -> None:
        """Make `param.grad` the bucket view again; see [Note: gradients as bucket views].

        Detached mode (buffer dtype differs): add the new gradient into the buffer, free it.
        """
        if bucket.flat is None:
            if bucket.params[position].grad is None:
                return
            self._allocate(bucket)
        param, view = bucket.params[position], bucket.views[position]
        grad = param.grad
        if not self._bound(bucket.flat, param):
            if grad is not None:
                view.add_(grad)
                param.grad = None
            return
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            return
        param.grad = view

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket_index, position = self._where[id(param)]
        bucket = self.buckets[bucket_index]
        self.seen.add(id(param))
        self._bind(bucket, position)
        if not self._armed or not getattr(param, "ds_grad_is_ready", True):   # more to come: tiled compute
            return
        if bucket_index < self._next_launch:
            name = self.names.get(id(param), f"shape {tuple(param.shape)}")
            raise RuntimeError(f"gradient of parameter {name} arrived after its bucket was already reduced: the "
                               "parameter took part in two backward phases (e.g. shared by a reentrant activation-"
                               "checkpointed region and the rest of the model); use non-reentrant checkpointing")
        bucket.pending.discard(position)
        while self._next_launch < len(self.buckets) and not self.buckets[self._next_launch].pending:
            self._launch(self._next_launch)

    def _launch(self, index: int) -> None:
        """Start the asynchronous reduction of bucket `index` (see [Note: bucket launch order])."""
        bucket = self.buckets[index]
        for position in range(len(bucket.params)):
            self._bind(bucket, position)
        if bucket.flat is None:
            self._allocate(bucket)  # no gradient on this rank: contribute zeros, every rank must join
        self._next_launch = index + 1
        if bucket.world <= 1:
            if self.reduces:   # an expert bucket held by one rank: averaged over the policy's world all the same
                bucket.flat.mul_(self.policy.before() * self.policy.after())
            return
        buffer = bucket.flat if bucket.comm_dtype == bucket.flat.dtype else bucket.flat.to(bucket.comm_dtype)
        scale = self.policy.before()
        if scale != 1.0:
            buffer.mul_(scale)
        if self.shard:
            chunk = buffer.numel() // bucket.world
            out = buffer[bucket.rank * chunk:(bucket.rank + 1) * chunk]  # in place: [Note: in-place reduce-scatter]
            bucket.comm_buffer = out
            bucket.work = ds_comm.reduce_scatter_tensor(out, buffer, group=bucket.group, async_op=True)
            if not self.overlap:
                self._complete(bucket)
            elif index > 0:  # at most two buckets in flight: bounds the temporaries (and, at ZeRO-1/2, full buffers)
                self._complete(self.buckets[index - 1])
            return
        bucket.comm_buffer = buffer
        bucket.work = ds_comm.all_reduce(buffer, group=bucket.group, async_op=True)

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for a launched bucket and put its result where it belongs."""
        if self.shard and bucket.world <= 1:  # one rank owns everything: the shard is the bucket
            self._accumulate(bucket, bucket.flat)
        elif bucket.work is None:
            return
        else:
            bucket.work.wait()
            buffer = bucket.comm_buffer
            scale = self.policy.after()
            if scale != 1.0:
                buffer.mul_(scale)
            if self.shard:
                self._accumulate(bucket, buffer)
            elif buffer is not bucket.flat:
                bucket.flat.copy_(buffer)
            bucket.work, bucket.comm_buffer = None, None
        if self.shard:  # its contributions now live in the owners' shards
            bucket.flat, bucket.views = None, []

    def _accumulate(self, bucket: _Bucket, reduced: torch.Tensor) -> None:
        """Add this rank's reduced slice into its gradient shard; the first reduction after
        zero_grad() creates the shard (a copy: the bucket buffer it views is dropped next)."""
        if bucket.shard_grad is None:
            bucket.shard_grad = reduced.to(dtype=self.accum_dtype or bucket.params[0].dtype, copy=True)
        else:
            bucket.shard_grad.add_(reduced)

    def shard_grad_of(self, bucket: _Bucket) -> torch.Tensor:
        """`bucket`'s gradient shard, created as zeros when nothing was reduced into it since
        zero_grad() (a step without backward, or a read or write between steps)."""
        if bucket.shard_grad is None:
            first = bucket.params[0]
            bucket.shard_grad = torch.zeros(bucket.shard_numel, dtype=self.accum_dtype or first.dtype,
                                            device=first.device)
        return bucket.shard_grad

    def finish(self) -> None:
        """Launch what is left and wait for every bucket."""
        if not self._armed:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
        for bucket in self.buckets:
            if bucket.flat is not None and (bucket.work is not None or bucket.world <= 1):
                self._complete(bucket)
        self._armed = False

    def bucket_fill(self) -> dict[torch.dtype, int]:
        """Elements already arrived in the bucket that reduces next, by communication dtype (0 while
        no reduction is armed): upstream's "ipg bucket" (optimizer.report_ipg_memory_usage)."""
        fill = {b.comm_dtype: 0 for b in self.buckets}
        if self._armed and self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            fill[bucket.comm_dtype] = sum(p.numel() for i, p in enumerate(bucket.params) if i not in bucket.pending)
        return fill

    def live_buffer_numel(self) -> int:
        """Elements of full-size gradient buffers currently allocated (memory accounting)."""
        return sum(b.flat.numel() for b in self.buckets if b.flat is not None)

    # --- step-time -----------------------------------------------------------------------
    def owns(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._where

    def params(self) -> list[torch.nn.Parameter]:
        return [p for bucket in self.buckets for p in bucket.params]

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The buffer slice holding `param`'s accumulated (and, after finish(), averaged) gradient."""
        bucket_index, position = self._where[id(param)]
        return self.buckets[bucket_index].views[position]

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Where `param`'s reduced gradient lives after finish(): its bucket view, or (sharded) its
        bucket's shard, which is exactly this rank's slice of `param` when `param` was given a
        bucket of its own (`solo`), laid out alike on every model holding it."""
        bucket_index, position = self._where[id(param)]
        bucket = self.buckets[bucket_index]
        if not self.shard:
            return bucket.views[position]
        if len(bucket.params) != 1:
            raise RuntimeError("reduced_grad of a sharded parameter needs a bucket of its own (solo)")
        return self.shard_grad_of(bucket)

    def rebind_flat(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        """Make `flat` the bucket's gradient buffer (moved by engine.offload_states): views and
        bound `.grad`s are cut from it again."""
        bucket.flat, bucket.views, offset = flat, [], 0
        for p in bucket.params:
            bucket.views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            if self._bound(flat, p) and p.grad is not None:
                p.grad = bucket.views[-1]

    def flat_buffers(self) -> list[torch.Tensor]:
        return [bucket.flat for bucket in self.buckets]

    def zero_grad(self) -> None:
        """Zero the replicated buffers, keeping `.grad` bound to them (no reallocation per step);
        drop the gradient shards (sharded mode: recreated by the next reduction)."""
        self.seen.clear()
        for bucket in self.buckets:
            bucket.shard_grad = None  # freed between steps, as upstream frees its averaged gradients
            if bucket.flat is None:
                for param in bucket.params:
                    param.grad = None
                continue
            bucket.flat.zero_()
            for position, param in enumerate(bucket.params):
                if not self._bound(bucket.flat, param):
                    param.grad = None  # detached mode: the buffer is the only gradient
                else:
                    self._bind(bucket, position)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
