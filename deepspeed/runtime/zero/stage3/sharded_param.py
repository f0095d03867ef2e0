"""ShardedUnit: the one owner of a gather unit's parameter storage, shard and gradient shard.

Each parameter of a unit is split on its own, as upstream does (rank r holds elements
[r*s, (r+1)*s) of it, s = ceil(numel/N), zero-padded), and a rank's `shard` is its pieces of the
unit's parameters back to back: see [Note: ZeRO-3 parameter-major shards] in unit_layout.py.
Between uses a rank holds only that shard (parameters' dtype) and its fp32 gradient shard
(`grad_shard`, the same layout); `gather()` is ONE all-gather, unpacked into the unit's flat
buffer, whose views become the parameters' `.data`; `prefetch()` issues that all-gather
asynchronously ahead of use (prefetch.py) and `gather()` then waits for it instead. With
`offload_param` both shards live in CPU memory (`shard_device`) and each gather copies the
shard to the compute device first.

This class is the only writer of the parameters' `.data` while they are sharded and of the
upstream-compatible attributes (param_attrs.py; published for downstream code such as Hugging
Face's `maybe_zero_3`; the runtime itself asks this object, never the attributes). `ds_tensor`
is upstream's per-parameter partition, a view of `shard`: what is written to it is what the
next gather shows.

[Note: ZeRO-3 release and autograd's saved tensors]
Forward saves tensors for backward that alias parameters: the parameter itself (a leaf:
autograd keeps the same TensorImpl, so it sees whatever `.data` is set to later) or a view of
it (Linear saves `weight.t()`, a different TensorImpl on the *same storage*). Release therefore
does two things: (1) `param.data` becomes an empty placeholder, as upstream does (shape and
numel read 0; `ds_shape`/`ds_numel` keep the real ones), and (2) the flat buffer's storage is
resized to 0 bytes, so a view saved by autograd frees its memory too instead of pinning the
whole gathered unit until backward. Gather resizes the *same* storage back and all-gathers into
it, then points `.data` at views of it again, so both kinds of saved tensor read the current
values. Safety rests on ordering, guaranteed by the coordinator: a module's backward reads its
saved tensors only after the pre-backward hook re-gathered the module's units (FSDP2 relies on
the same storage-resize aliasing; see its "[Note: FSDP and autograd]"). Setting `.data` does
not bump the version counter, so autograd's saved-tensor version checks are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .... import comm as ds_comm
from ..partition import ParamwisePartition
from . import init_context, param_attrs, watchdog
from .param_attrs import OWNER_ATTR as _OWNER_ATTR
from .hpz import SecondaryShard
from .param_attrs import ZeroParamStatus, unit_of
from .unit_layout import UnitLayout
from .units import UnitSpec


@dataclass
class GatherStats:
    """Gather bookkeeping shared by a coordinator's units: what prefetching did, and the resident
    (gathered or in-flight) elements of non-persistent units that max_live_parameters bounds."""

    sync: int = 0          # all-gathers issued and waited for on the spot
    prefetched: int = 0    # asynchronous all-gathers issued ahead of use
    waited: int = 0        # uses that waited on a prefetched all-gather instead of issuing one
    wasted: int = 0        # prefetches completed and released unused (the trace changed)
    live: int = 0
    peak_live: int = 0

    def resident(self, delta: int) -> None:
        self.live += delta
        self.peak_live = max(self.peak_live, self.live)


class _Owner:
    """A parameter's link to the unit owning it, for callers that hold only a parameter
    (GatheredParameters), stored on the parameter: a released parameter's data lives in its unit,
    so the parameter keeps the unit alive, and the cycle (parameter -> unit -> parameter) goes
    when both are garbage. (A module-level weak-key map held the unit strongly from outside the
    cycle: every dropped ZeRO-3 model stayed alive.) Not copied or pickled with the parameter: a
    copy is not in the unit."""

    __slots__ = ("unit",)

    def __init__(self, unit: "ShardedUnit") -> None:
        self.unit = unit

    def __reduce__(self) -> tuple:
        return (_no_owner, ())

    def __deepcopy__(self, memo: dict) -> None:
        return None


def _no_owner() -> None:
    return None


class ShardedUnit:
    """Shard, gather buffer, gradient shard and gather/release bookkeeping of one unit."""

    spec: UnitSpec
    params: list[nn.Parameter]
    partition: ParamwisePartition
    layout: UnitLayout
    shard: torch.Tensor          # 1D, params' dtype: this rank's piece of every parameter, back to back
    grad_dtype: torch.dtype = torch.float32   # of grad_shard (set_grad_dtype)
    status: ZeroParamStatus

    def __init__(self, spec: UnitSpec, params: list[nn.Parameter], group: Any = None,
                 shard_device: torch.device | None = None, pin_memory: bool = False,
                 stats: GatherStats | None = None) -> None:
        """`shard_device`: where `shard` and `grad_shard` live between uses (CPU with
        offload_param; default: the parameters' device, where gathers and compute happen).
        `stats`: shared with the coordinator's other units (a private one by default)."""
        self.stats = stats if stats is not None else GatherStats()
        self._pending: watchdog.PendingGather | None = None
        self._swap: Any = None            # offload_param nvme: [Note: parameter swapping] (swap_tensor/)
        self._received: torch.Tensor | None = None   # a rank-major all-gather buffer not yet unpacked
        self.quantize_weights = False     # qwZ: [Note: qwZ quantized weight all-gather] (zero/qwz.py)
        self.secondary: SecondaryShard | None = None   # hpZ: [Note: hpZ secondary partition] (hpz.py)
        self._exact = True                # the gathered values are the shards' (not dequantised)
        self._primary = False             # the pending gather is the primary one: refresh the secondary
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO-3 unit of module '{spec.owner}' mixes dtypes/devices {sorted(map(str, dtypes))}; "
                             f"a unit is gathered as one flat buffer, so its parameters must agree")
        self.spec, self.params, self.group = spec, params, group
        self.rank, self.world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
        for p in params:   # upstream's per-parameter record of the ranks it is partitioned over
            p.ds_zero_partition_world_size = self.world
        self.layout = UnitLayout(spec.numels, self.world)
        self.partition = self.layout.partition
        self.shapes = [init_context.full_shape(p) for p in params]
        self.offsets = self.layout.offsets
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        first = params[0]
        self._new_flat(torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=first.device))
        # Flatten the unit and keep our pieces: a full parameter is copied; a zero.Init one keeps
        # its slice, which is already our piece (partitioned over the same ranks; else it is
        # all-gathered into place). The full model never exists in one process.
        # ds_id survives initialize (zero.Init gave one); other parameters get theirs here.
        self._ds_ids = [getattr(p, "ds_id", None) if init_context.init_shard(p) is not None else None
                        for p in params]
        adopted: dict[int, torch.Tensor] = {}
        for i, (view, p) in enumerate(zip(self._views, params)):
            if init_context.partitioned_like(p, group):
                adopted[i] = init_context.take_over(p).shard
            elif init_context.init_shard(p) is not None:
                init_context.adopt_into(p, view)
            else:
                view.copy_(p.detach())
            p.data = view
            setattr(p, _OWNER_ATTR, _Owner(self))
        self.shard_device = shard_device if shard_device is not None else first.device
        self.shard = self.layout.row(self.flat, self.rank).to(self.shard_device)
        for i, piece in adopted.items():
            self.layout.piece(self.shard, i).copy_(piece)
        # This rank's slice (fp32: grad_dtype) of the reduced gradients, accumulated across micro-steps; created
        # by the first reduction after a step and dropped at zero_grad (`release_grad`), unless
        # pinned (a pinned allocation per step would cost more than the memory).
        self._grad_shard: torch.Tensor | None = None
        self._pinned = pin_memory
        if pin_memory:
            self.shard, self._grad_shard = self.shard.pin_memory(), self._new_grad_shard().pin_memory()
        self._shard_listeners: list[Callable[[torch.Tensor], None]] = []
        self.status = ZeroParamStatus.AVAILABLE
        self.stats.resident(0 if spec.persistent else spec.numel)
        self._refs = 0                       # active forward uses (nested / re-entrant calls)
        self._held = False                   # needed by the current backward until reduced
        self._ready: set[int] = set()        # trainable params whose grad arrived in this backward
        self._reduced = False                # reduced in the current backward
        self._publish_compat_attrs()
        if not spec.persistent:
            self._free()
        elif adopted:   # the zero.Init pieces are in the shard only
            self.refresh()

    # --- the shard (in a swap file with offload_param nvme) ----------------------------------
    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice; with NVMe offload read in first ([Note: parameter swapping])."""
        if self._swap is not None:
            self._swap.ensure(self)
        return self._shard

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        if self._swap is not None:
            raise RuntimeError(f"ZeRO-3: {self}'s shard lives in a swap file (offload_param nvme); it cannot be "
                               f"replaced (offload_states is not supported with NVMe parameter offload)")
        self._shard = value

    @property
    def raw_shard(self) -> torch.Tensor:
        """The shard tensor as it is now (a placeholder when swapped out): for the swapper."""
        return self._shard

    def attach_swapper(self, swapper: Any) -> None:
        self._swap = swapper

    def bind_shard_storage(self, tensor: torch.Tensor) -> None:
        """The swapper moved the shard: `shard` (the same object) and `ds_tensor` now view `tensor`."""
        self._shard.set_(tensor)
        for i, p in enumerate(self.params):
            if "ds_tensor" in p.__dict__:
                p.ds_tensor.data = self.layout.piece(self._shard, i)

    def overwrite_shard(self, values: torch.Tensor) -> None:
        """`shard` := `values` (cast), all of it: swapped-out shards are not read first."""
        if self._swap is not None:
            self._swap.fresh(self)
        self._shard.copy_(values)

    # --- compat attributes ------------------------------------------------------------------
    def _publish_compat_attrs(self) -> None:
        for i, p in enumerate(self.params):
            ds_id = self._ds_ids[i] if self._ds_ids[i] is not None else param_attrs.next_ds_id()
            param_attrs.publish(p, ds_id=ds_id, shape=self.shapes[i], persist=self.spec.persistent,
                                tensor=self.layout.piece(self.shard, i), world=self.world, status=self.status)

    def _set_status(self, status: ZeroParamStatus) -> None:
        was = self.status is not ZeroParamStatus.NOT_AVAILABLE
        self.status = status
        now = status is not ZeroParamStatus.NOT_AVAILABLE
        if was != now and not self.spec.persistent:
            self.stats.resident(self.spec.numel if now else -self.spec.numel)
        for p in self.params:
            p.ds_status = status

    def _new_flat(self, flat: torch.Tensor) -> None:
        """`flat` becomes the gather buffer; the parameters' views are cut from it."""
        self.flat = flat
        self._views = [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.spec.numels, self.shapes)]

    def rebind_shard(self, shard: torch.Tensor) -> None:
        """Make `shard` this rank's slice (moved by engine.offload_states); `ds_tensor` views it
        again. Where shards are kept between uses (`shard_device`) does not change."""
        self.take_rebound_pieces()
        self.shard = shard
        for i, p in enumerate(self.params):
            p.ds_tensor.data = self.layout.piece(shard, i)

    @property
    def grad_shard_if_any(self) -> torch.Tensor | None:
        return self._grad_shard

    def rebind_grad_shard(self, grad: torch.Tensor) -> None:
        self._grad_shard = grad

    def take_rebound_pieces(self) -> None:
        """`p.ds_tensor.data = t` (upstream's own tests set partitions that way) rebinds the view
        to another tensor instead of writing the shard: take its values into the shard and point
        `ds_tensor` back at its piece, as a write through the view would have done (neither
        reaches the optimizer's fp32 masters, as upstream)."""
        base, item = self.shard.data_ptr(), self.shard.element_size()
        for i, p in enumerate(self.params):
            tensor = p.__dict__.get("ds_tensor")
            if tensor is None or not self.layout.sizes[i] or tensor.data_ptr() == base + item * self.layout.starts[i]:
                continue
            piece = self.layout.piece(self.shard, i)
            if tensor.shape != piece.shape:
                raise RuntimeError(f"ZeRO-3: ds_tensor of a parameter of '{self.spec.owner}' was given shape "
                                   f"{tuple(tensor.shape)}; this rank's partition has shape {tuple(piece.shape)}")
            piece.copy_(tensor.detach())
            tensor.data = piece
            self.shard_changed()

    # --- gather / release -------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.status is ZeroParamStatus.AVAILABLE

    def configure_zeropp(self, quantize_weights: bool = False, hpz_group: Any = None) -> None:
        """ZeRO++ for this unit's gathers: qwZ (int8 all-gathers) and hpZ (a secondary copy
        within `hpz_group`, a node of ZeRO's group). Called before the first gather."""
        self.quantize_weights = quantize_weights
        self.secondary = SecondaryShard(self.layout, hpz_group) if hpz_group is not None else None

    def shard_changed(self) -> None:
        """Whoever writes `shard` calls this (on every rank alike): hpZ's secondary copy is stale."""
        if self.secondary is not None:
            self.secondary.invalidate()

    def gather(self, exact: bool = False) -> None:
        """ONE all-gather of the unit, or the wait for its prefetch; parameters become views of
        the flat buffer. See [Note: ZeRO-3 release and autograd's saved tensors]. `exact`: the
        values must be the shards' even under qwZ (a unit gathered quantised is gathered again)."""
        if self.available and (self._exact or not exact):
            return
        if self.status is ZeroParamStatus.INFLIGHT:
            self.stats.waited += 1
            self._finish_prefetch()
            return self.gather(exact)
        if self.available:   # re-gather exactly into the same (allocated) storage
            self._set_status(ZeroParamStatus.NOT_AVAILABLE)
        phase = "backward" if self._held else ("forward" if self._refs else "post-step")
        self._fill(self._gather_buffer(), phase, exact)
        self.stats.sync += 1
        self._show_gathered()

    def _fill(self, out: torch.Tensor, phase: str, exact: bool, start: bool = False) -> "watchdog.PendingGather | None":
        """Issue the gather into `out` (`_gather_buffer`'s): hpZ's secondary copy within the node
        where it is valid, else the primary all-gather (int8 under qwZ unless `exact`). Waited for
        here, or (`start`, a prefetch) returned in flight: its `finish()` completes the buffer."""
        secondary = self.secondary
        if secondary is not None and secondary.valid and (secondary.exact or not exact):
            self._received = None
            self._exact, self._primary = secondary.exact, False
            return secondary.gather_into(self.flat, self.spec, phase, start)
        shard = self.shard.detach().to(self.flat.device)   # its own reference: a swap may rebind `shard`
        quantize = self.quantize_weights and not exact and ds_comm.is_initialized() and shard.numel() > 0
        self._exact, self._primary = not quantize, True
        gather = watchdog.quantized_all_gather if quantize else watchdog.gather_or_copy
        return gather(out, shard, self.group, self.spec, phase, start=start)

    def _gather_buffer(self) -> torch.Tensor:
        """Re-allocate `flat` and return what the all-gather writes: `flat` itself where the
        layouts coincide, else a rank-major buffer that `_show_gathered` unpacks into it."""
        self.take_rebound_pieces()
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        if not self.layout.direct:
            self._received = torch.empty_like(self.flat)
        return self._received if not self.layout.direct else self.flat

    def _show_gathered(self) -> None:
        received, self._received = self._received, None
        if received is not None:
            self.layout.unpack(received, self.flat)
            del received
        if self._primary and self.secondary is not None:
            self.secondary.take(self.flat, self._exact)
        self._primary = False
        for view, p in zip(self._views, self.params):
            p.data = view
        self._set_status(ZeroParamStatus.AVAILABLE)

    def prefetch(self, phase: str) -> None:
        """Start the unit's all-gather without waiting (asynchronous, into `flat`); the next
        `gather()` waits for it instead of issuing one. `.data` stays the placeholder meanwhile."""
        if self.status is not ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"ZeRO-3: prefetch of {self}, which is not released")
        self._pending = self._fill(self._gather_buffer(), phase, exact=False, start=True)
        self.stats.prefetched += 1
        self._set_status(ZeroParamStatus.INFLIGHT)

    def _finish_prefetch(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()
        self._show_gathered()

    def drop_prefetch(self) -> None:
        """A prefetch nobody used: wait for it (every rank issued it, so it completes) and
        release the unit unless something acquired it meanwhile."""
        if self.status is ZeroParamStatus.INFLIGHT:
            self.stats.wasted += 1
            self._finish_prefetch()
            self._maybe_free()

    def _free(self, keep_aliases: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                raise RuntimeError(f"ZeRO-3: releasing '{self.spec.owner}' while a parameter still has a .grad")
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if keep_aliases:   # the buffer goes to whoever still references it; the next gather gets a new one
            self._new_flat(torch.empty_like(self.flat))
        self.flat.untyped_storage().resize_(0)
        self._set_status(ZeroParamStatus.NOT_AVAILABLE)

    def _maybe_free(self, keep_aliases: bool = False) -> None:
        if self._refs == 0 and not self._held and not self.spec.persistent and self.available:
            self._free(keep_aliases)

    def acquire(self, exact: bool = False) -> None:
        """A forward use begins: gather if needed (`exact`: see `gather`). Balanced by `release()`."""
        self._refs += 1
        self.gather(exact)

    def release(self, keep_aliases: bool = False) -> None:
        """A forward use ends; the unit is freed once no forward use nor backward needs it.
        `keep_aliases` (the end of a GatheredParameters block): tensors the user took from the
        parameters meanwhile (`p.detach()`) keep their values, as upstream's, instead of being
        emptied with the buffer (see [Note: ZeRO-3 release and autograd's saved tensors])."""
        if self._refs <= 0:
            raise RuntimeError(f"ZeRO-3: unbalanced release of unit '{self.spec.owner}'")
        self._refs -= 1
        self._maybe_free(keep_aliases)

    def release_unused(self) -> None:
        """Free the unit if it is gathered with no forward use nor backward needing it (a gather the user
        asked for: param.all_gather_coalesced)."""
        self._maybe_free()

    @property
    def held(self) -> bool:
        return self._held

    def hold_for_backward(self) -> None:
        """A module using this unit is about to run its backward: keep it gathered until reduced."""
        self._held = True
        self.gather()

    def refresh(self) -> None:
        """After `shard` changed (an optimizer step): re-gather a persistent unit now."""
        self.shard_changed()
        if self.available and self.spec.persistent:
            self.status = ZeroParamStatus.NOT_AVAILABLE   # force the collective; storage stays allocated
            self.gather()

    # --- writes from outside the optimizer (GatheredParameters with a modifier rank) ----------
    def add_shard_listener(self, listener: Callable[[torch.Tensor], None]) -> None:
        """`listener(changed)` runs after `scatter_from` rewrote `shard`; `changed` is a bool mask
        over the shard (Stage3Optimizer refreshes those elements of its fp32 master)."""
        self._shard_listeners.append(listener)

    def scatter_from(self, src: int) -> None:
        """The unit is gathered and group rank `src` may have changed its parameters: broadcast
        the flat buffer from it and rewrite every rank's `shard` (collective)."""
        if not self.available:
            raise RuntimeError(f"ZeRO-3: {self} must be gathered to take new values")
        for view, p in zip(self._views, self.params):
            if p.data.shape != view.shape:
                raise RuntimeError(f"ZeRO-3: a parameter of '{self.spec.owner}' of shape {tuple(view.shape)} was "
                                   f"given a tensor of shape {tuple(p.data.shape)}; sizes are fixed at initialize")
            if p.data.data_ptr() != view.data_ptr():   # `.data` replaced: take the new values
                view.copy_(p.data)
                p.data = view
        if self.world > 1 and self.flat.numel():
            ds_comm.broadcast(self.flat, src=ds_comm.get_global_rank(self.group, src), group=self.group)
        new = self.layout.row(self.flat, self.rank).to(self.shard.device)   # (offload_states may have moved it)
        changed = new != self.shard
        if bool(changed.any()):
            self.shard.copy_(new)
            self.shard_changed()
            for listener in self._shard_listeners:
                listener(changed)

    def disown(self) -> None:
        """The unit stops owning its parameters (the coordinator was removed)."""
        for p in self.params:
            if unit_of(p) is self:
                delattr(p, _OWNER_ATTR)

    # --- gradients --------------------------------------------------------------------------
    def grad_arrived(self, param_index: int) -> bool:
        """Record that a trainable param's gradient is accumulated; True when the unit is complete."""
        if self._reduced:
            raise RuntimeError(f"ZeRO-3: a second gradient for a parameter of unit '{self.spec.owner}' arrived "
                               f"after the unit was reduced in this backward (re-entrant use is not supported)")
        self._ready.add(param_index)
        return len(self._ready) == len(self.trainable)

    def take_grads(self) -> torch.Tensor | None:
        """The unit's gradients are complete: return them as ONE padded flat tensor (parameters'
        dtype; parameters without a gradient in this backward contribute zeros, as ranks must
        issue identical collectives), drop the parameters' `.grad` and release the unit. None
        when there is nothing to reduce. The caller reduce-scatters it (reducer.py) and hands
        this rank's slice to `add_reduced`."""
        flat_grad = None
        if self.layout.padded_numel and self.trainable:
            flat_grad = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype, device=self.flat.device)
            rows = flat_grad.view(self.world, self.layout.shard_numel)
            for i in self.trainable:
                g = self.params[i].grad
                if g is not None:
                    self.layout.pack_into(rows, i, g.reshape(-1))
        for p in self.params:
            p.grad = None
        self._reduced, self._held = True, False
        self._ready.clear()
        self._maybe_free()
        return flat_grad

    def add_reduced(self, summed: torch.Tensor, scale: float | None = None) -> None:
        """This rank's slice of the gradients summed over ranks, times `scale` (default 1/N: the
        average), into `grad_shard` (accumulated across micro-steps)."""
        alpha = 1.0 / self.world if scale is None else scale
        summed = summed.to(self.shard_device, self.grad_dtype)
        if self._grad_shard is None:
            self._grad_shard = summed.mul(alpha)
        else:
            self._grad_shard.add_(summed, alpha=alpha)

    def _new_grad_shard(self) -> torch.Tensor:
        return torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.shard_device)

    def set_grad_dtype(self, dtype: torch.dtype) -> None:
        """Hold `grad_shard` in `dtype` (low-precision ZeRO masters: bf16/fp16 gradient partitions);
        before any reduction."""
        self.grad_dtype = dtype
        if self._grad_shard is not None:
            self._grad_shard = self._new_grad_shard().pin_memory() if self._pinned else None

    @property
    def grad_shard(self) -> torch.Tensor:
        """The gradient slice; zeros when nothing was reduced into it since the last zero_grad."""
        if self._grad_shard is None:
            self._grad_shard = self._new_grad_shard()
        return self._grad_shard

    def release_grad(self) -> None:
        """zero_grad: drop the gradient slice (zero it when pinned)."""
        if self._pinned:
            self._grad_shard.zero_()
        else:
            self._grad_shard = None

    def end_backward(self) -> None:
        """The backward finished: forget its bookkeeping and drop the backward hold."""
        self._held, self._reduced = False, False
        self._ready.clear()
        self._maybe_free()

    @property
    def needs_reduce(self) -> bool:
        return bool(self.trainable) and not self._reduced

    @property
    def forward_refs(self) -> int:
        return self._refs

    # --- whole-unit views -------------------------------------------------------------------
    def gather_full(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """All-gather a shard laid out like this unit (params or grads) and split it per parameter."""
        if shard is self.shard:
            self.take_rebound_pieces()
        full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=self.flat.device)
        if full.numel():
            watchdog.gather_or_copy(full, shard.to(self.flat.device), self.group, self.spec, "full-state")
        return self.layout.split(full, self.shapes)

    def __repr__(self) -> str:
        return (f"ShardedUnit({self.spec.owner or '<root>'}, numel={self.spec.numel}, "
                f"shard={self.layout.shard_numel}, {self.status.name}, persistent={self.spec.persistent})")
