"""`engine.offload_states()` / `engine.reload_states()`: this rank's ZeRO training state off the
accelerator and back, between training phases (RLHF frameworks free the device for generation
or for a second model this way), and upstream's `get_state_devices` to see where it is.

[Note: moving state with its aliases]
Each kind of state (OffloadStateTypeEnum) is a list of Slots: one tensor, read through `get`
(None when it does not exist right now, e.g. gradients between steps), and `put`, its owner's
rebind, which points every alias at the moved tensor (the fragment masters view the fp32 master
shard, the parameters view their bucket's buffer, `ds_tensor` views the ZeRO-3 shard). Nothing
then keeps the old storage alive, so its memory is freed at once. The device each slot came
from (and whether it was pinned) is remembered for `reload_states()`.

    optim_states            the base optimizer's state tensors (exp_avg, exp_avg_sq, ...)
    hp_params               the fp32 master shards
    lp_params               the model's parameters: stages 1-2 their bucket buffers (and
                            parameters outside buckets, e.g. frozen); stage 3 the shards
                            (`ds_tensor`); units gathered at the time (persistent ones, those
                            inside GatheredParameters) keep their full parameters on the device
    lp_grads                the reduced gradient shards (they exist from a backward's reduction
                            to the step) and their master-side copies
    contiguous_grad_buffer  stages 1-2: the full-size gradient buckets that hold accumulated
                            gradients between micro-steps before a reduction; stage 3 keeps no
                            gradient buffer between backwards (nothing to move)

A stage-1/2 forward and any step need the state back (`reload_states()`), and say so; a ZeRO-3
forward works with offloaded shards (each gather copies the unit's shard to the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .offload_config import OffloadDeviceEnum, OffloadStateTypeEnum


@dataclass
class Slot:
    get: Callable[[], "torch.Tensor | None"]
    put: Callable[[torch.Tensor], None]


def _already_there(tensor: torch.Tensor, device: torch.device) -> bool:
    """State already on the target device stays as it is (pinning applies to what moves)."""
    return tensor.device == device


def _move(tensor: torch.Tensor, device: torch.device, pin: bool, non_blocking: bool) -> torch.Tensor:
    if _already_there(tensor, device):
        return tensor
    pin = pin and device.type == "cpu" and torch.cuda.is_available()   # pinning needs an accelerator runtime
    moved = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    moved.copy_(tensor, non_blocking=non_blocking)
    return moved


def _attr_slot(owner: Any, name: str) -> Slot:
    return Slot(lambda: getattr(owner, name), lambda t: setattr(owner, name, t))


def _optimizer_state_slots(base: torch.optim.Optimizer) -> list[Slot]:
    slots = []
    for state in base.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                slots.append(Slot(lambda s=state, k=key: s[k], lambda t, s=state, k=key: s.__setitem__(k, t)))
    return slots


def _master_slots(shards: Iterable[Any]) -> list[Slot]:
    return [Slot(lambda s=s: s.master, s.rebind_master) for s in shards]


def _master_grad_slots(shards: Iterable[Any]) -> list[Slot]:
    return [Slot(lambda s=s: s.master_grad_copy, s.rebind_master_grad) for s in shards]


def _stage12_slots(optimizer: Any, module: torch.nn.Module, kind: OffloadStateTypeEnum) -> list[Slot]:
    reducer = optimizer.reducer
    if kind is OffloadStateTypeEnum.lp_params:
        in_buckets = {id(p) for sb in optimizer.buckets for p in sb.params}
        slots = [Slot(lambda sb=sb: sb.param_flat, sb.rebind_param_flat) for sb in optimizer.buckets]
        seen: set[int] = set()
        for p in module.parameters():   # frozen parameters and others the optimizer does not own
            if id(p) not in in_buckets and id(p) not in seen:
                seen.add(id(p))
                slots.append(Slot(lambda p=p: p.data, lambda t, p=p: setattr(p, "data", t)))
        return slots
    if kind is OffloadStateTypeEnum.lp_grads:
        return [_attr_slot(b, "shard_grad") for b in reducer.buckets] + _master_grad_slots(optimizer.buckets)
    if kind is OffloadStateTypeEnum.contiguous_grad_buffer:
        return [Slot(lambda b=b: b.flat, lambda t, b=b: reducer.rebind_flat(b, t)) for b in reducer.buckets]
    return _common_slots(optimizer, kind)


def _stage3_slots(optimizer: Any, kind: OffloadStateTypeEnum) -> list[Slot]:
    units = optimizer.coordinator.units
    if kind is OffloadStateTypeEnum.lp_params:
        return [Slot(lambda u=u: u.shard, u.rebind_shard) for u in units]
    if kind is OffloadStateTypeEnum.lp_grads:
        return [Slot(lambda u=u: u.grad_shard_if_any, u.rebind_grad_shard) for u in units] + \
               _master_grad_slots(optimizer.units)
    if kind is OffloadStateTypeEnum.contiguous_grad_buffer:
        return []
    return _common_slots(optimizer, kind)


def _common_slots(optimizer: Any, kind: OffloadStateTypeEnum) -> list[Slot]:
    shards = optimizer.buckets if hasattr(optimizer, "buckets") else optimizer.units
    if kind is OffloadStateTypeEnum.hp_params:
        return _master_slots(shards)
    return _optimizer_state_slots(optimizer.optimizer)


def state_slots(engine: Any, kind: OffloadStateTypeEnum) -> list[Slot]:
    """The slots of one kind of `engine`'s state (a ZeRO stage 1-3 engine with an optimizer)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "coordinator"):
        return _stage3_slots(optimizer, kind)
    if hasattr(optimizer, "buckets") and hasattr(optimizer, "reducer"):
        return _stage12_slots(optimizer, engine.module, kind)
    stage = engine.zero_optimization_stage()
    raise NotImplementedError(f"offload_states() needs ZeRO stage 1, 2 or 3 with an optimizer; this engine has "
                              f"zero_optimization.stage={stage}"
                              f"{'' if engine._has_optimizer else ' and no optimizer'}")


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> set[torch.device]:
    """Upstream's helper: the devices the tensors of `state` are on now (empty when none exists)."""
    return {t.device for slot in state_slots(model, OffloadStateTypeEnum(state)) if (t := slot.get()) is not None}


def _kinds(include: Any) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, (str, OffloadStateTypeEnum)):
        include = [include]
    kinds = []
    for item in include:
        try:
            kinds.append(OffloadStateTypeEnum(item))
        except ValueError:
            raise ValueError(f"offload_states(include=...): {item!r} is not a state type; allowed: "
                             f"{[k.value for k in OffloadStateTypeEnum]} (or None for all)") from None
    return kinds


_NEEDED_BY = {"forward": set(), "eval_batch": set(), "step": set(OffloadStateTypeEnum),
              "train_batch": set(OffloadStateTypeEnum),   # the PipelineEngine's forward, backward and step
              "backward": {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer}}


class OffloadStates:
    """The engine's `offload_states` / `reload_states` (upstream's signatures)."""

    def offload_states(self, include: Any = None, device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the state kinds in `include` (OffloadStateTypeEnum values; None: all) to `device`
        (only "cpu"), pinned if `pin_memory` (where an accelerator runtime can pin). Kinds already
        offloaded are left as they are. With `non_blocking`, synchronize before reading them."""
        if str(getattr(device, "value", device)) != OffloadDeviceEnum.cpu.value:
            raise ValueError(f"offload_states(device={device!r}): only 'cpu' (OffloadDeviceEnum.cpu) is supported")
        kinds = _kinds(include)
        slots = {kind: state_slots(self, kind) for kind in kinds}   # raises first for an engine without ZeRO
        self._refuse_offload_mid_pass()
        target = torch.device("cpu")  # host: offload_states' only device
        offloaded = self.__dict__.setdefault("_offloaded_states", {})
        for kind in kinds:
            if kind in offloaded:
                continue
            # Recorded before it moves: if a move fails half-way, what moved is known (the guards
            # stay on and reload_states() brings it back).
            record = offloaded[kind] = []
            for slot in slots[kind]:
                tensor = slot.get()
                if tensor is None or _already_there(tensor, target):
                    continue
                record.append((slot, tensor.device, tensor.is_pinned()))
                slot.put(_move(tensor, target, pin_memory, non_blocking))
            if not record:   # nothing of this kind to move: nothing to refuse or bring back
                del offloaded[kind]

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move everything `offload_states()` moved back where it was."""
        offloaded = self.__dict__.get("_offloaded_states") or {}
        for kind in list(offloaded):
            for slot, device, pinned in offloaded[kind]:
                tensor = slot.get()
                if tensor is not None:   # (gradients dropped by a zero_grad() meanwhile stay dropped)
                    slot.put(_move(tensor, device, pinned, non_blocking))   # (a no-op for what is back)
            del offloaded[kind]   # only once all of it is back: a failed reload can be retried

    def offloaded_state_kinds(self) -> list[OffloadStateTypeEnum]:
        return list(self.__dict__.get("_offloaded_states") or {})

    def _refuse_offload_mid_pass(self) -> None:
        if self.inside_no_sync_ctxt:
            raise RuntimeError("offload_states() inside no_sync()/coalesce_grad_reduction(): gradients held back "
                               "there are not moved; leave the block first")
        if self._stage3 is not None:
            self._stage3.release_cache()   # raises inside a forward or backward
        elif self._reducer is not None and self._reducer.armed:
            raise RuntimeError("offload_states() while gradients are being reduced (call it after backward "
                               "or after step)")

    def _refuse_if_offloaded(self, action: str) -> None:
        """Raise if state that `action` (a key of _NEEDED_BY) needs is offloaded: a step (and a
        pipeline's train_batch) needs all of it; a backward the gradient state; at stages 1-2 every
        action also needs the parameters (a ZeRO-3 gather copies the shard to the device)."""
        offloaded = self.__dict__.get("_offloaded_states")
        if not offloaded:
            return
        needs = _NEEDED_BY[action] | ({OffloadStateTypeEnum.lp_params} if self._stage3 is None else set())
        blocking = [k.value for k in offloaded if k in needs]
        if blocking:
            raise RuntimeError(f"engine.{action}() needs the training state back on the device: {blocking} "
                               "offloaded by offload_states(); call engine.reload_states() first")


__all__ = ["OffloadStates", "get_state_devices", "state_slots", "OffloadDeviceEnum", "OffloadStateTypeEnum"]
