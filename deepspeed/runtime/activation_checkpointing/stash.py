"""Where a checkpointed region's inputs wait for their recompute.

Plain checkpointing keeps each input tensor as is. The memory options change that:
- `partition_activations`: model-parallel ranks hold identical activations, so each rank keeps
  1/mp of every floating-point input (padded to a multiple of mp) and the recompute all-gathers it
  over the model-parallel group through `deepspeed.comm` (so the bytes are counted);
- `checkpoint_in_cpu`: the kept tensor (the piece, or the whole input) lives in CPU memory;
- `contiguous_checkpointing`: the pieces of the `num_checkpoints` regions of one forward are
  copied into one preallocated buffer instead of as many small allocations (less fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ... import comm as ds_comm


class ContiguousBuffer:
    """One flat buffer of `num_checkpoints` equal slots, one slot per checkpointed region.

    A slot is taken in forward and given back after its recompute; when none is in use the next
    forward starts again at slot 0. `reset()` forgets the slots in use (eval loops that run
    forwards without backward).
    """

    def __init__(self, num_checkpoints: int) -> None:
        self.num_checkpoints = num_checkpoints
        self.flat: Optional[torch.Tensor] = None
        self.next_slot = 0
        self.in_use = 0

    def take(self, pieces: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Copy `pieces` into the next slot and return views of them there."""
        slot_numel = sum(p.numel() for p in pieces)
        dtype = pieces[0].dtype
        if any(p.dtype != dtype for p in pieces):
            raise ValueError("contiguous_checkpointing (activation_checkpointing.contiguous_memory_optimization) "
                             "needs the partitioned inputs of a region to share one dtype; got "
                             f"{sorted({str(p.dtype) for p in pieces})}")
        if self.flat is None:
            self.flat = torch.empty(self.num_checkpoints * slot_numel, dtype=dtype, device=device)
        if self.flat.numel() != self.num_checkpoints * slot_numel or self.flat.dtype != dtype:
            raise ValueError("contiguous_checkpointing needs homogeneous checkpoints: every region's partitioned "
                             f"inputs must total the same size and dtype ({self.flat.numel() // self.num_checkpoints} "
                             f"x {self.flat.dtype} per region in this buffer, got {slot_numel} x {dtype})")
        if self.next_slot >= self.num_checkpoints:
            raise RuntimeError(f"contiguous_checkpointing: more than num_checkpoints={self.num_checkpoints} regions "
                               "were checkpointed before a backward; raise activation_checkpointing."
                               "number_checkpoints, or call deepspeed.checkpointing.reset() between forwards "
                               "that have no backward")
        offset = self.next_slot * slot_numel
        self.next_slot += 1
        self.in_use += 1
        views = []
        for p in pieces:
            view = self.flat.narrow(0, offset, p.numel())
            view.copy_(p)
            views.append(view)
            offset += p.numel()
        return views

    def give_back(self) -> None:
        self.in_use = max(self.in_use - 1, 0)
        if self.in_use == 0:
            self.next_slot = 0

    def reset(self) -> None:
        self.next_slot = 0
        self.in_use = 0


@dataclass(frozen=True)
class StashPlan:
    """How the inputs of one region are kept: made by the owner from its settings and mpu."""

    mp_group: Any = None
    mp_rank: int = 0
    mp_size: int = 1
    to_cpu: bool = False
    buffer: Optional[ContiguousBuffer] = None

    @property
    def changes_anything(self) -> bool:
        return self.mp_size > 1 or self.to_cpu


@dataclass
class _Kept:
    data: torch.Tensor          # the whole tensor, or this rank's padded flat piece
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool


class InputStash:
    """The tensor inputs of one region, kept as the plan says until `restore()`."""

    def __init__(self, tensors: list[torch.Tensor], plan: StashPlan) -> None:
        self.plan = plan
        self.input_nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._in_buffer = False
        kept = [self._keep(t) for t in tensors]
        pieces = [k for k in kept if k.partitioned]
        if plan.buffer is not None and pieces:
            device = torch.device("cpu") if plan.to_cpu else pieces[0].device  # host: checkpoint_in_cpu
            for k, view in zip(pieces, plan.buffer.take([k.data for k in pieces], device)):
                k.data = view
            self._in_buffer = True
        self.kept = kept
        self.kept_nbytes = sum(k.data.numel() * k.data.element_size() for k in kept)

    def _keep(self, t: torch.Tensor) -> _Kept:
        plan = self.plan
        split = plan.mp_size > 1 and t.is_floating_point() and t.numel() >= plan.mp_size
        if split:
            piece_numel = -(-t.numel() // plan.mp_size)
            flat = t.detach().reshape(-1)
            start = min(plan.mp_rank * piece_numel, flat.numel())
            mine = flat[start:start + piece_numel]
            data = torch.zeros(piece_numel, dtype=t.dtype, device="cpu" if plan.to_cpu else t.device)
            data[:mine.numel()].copy_(mine)   # a copy: a view would keep the whole input alive
        elif plan.to_cpu and t.device.type != "cpu":
            data = t.detach().to("cpu", copy=True)
        else:
            data = t.detach()
        return _Kept(data, t.shape, t.device, t.requires_grad, split)

    def restore(self) -> list[torch.Tensor]:
        """The inputs again, on their devices, detached, requiring grad as they did."""
        out = [self._restore_one(k) for k in self.kept]
        if self._in_buffer:
            self.plan.buffer.give_back()
            self._in_buffer = False
        return out

    def _restore_one(self, k: _Kept) -> torch.Tensor:
        data = k.data.to(k.device, non_blocking=True) if k.data.device != k.device else k.data
        if k.partitioned:
            full = torch.empty(data.numel() * self.plan.mp_size, dtype=data.dtype, device=k.device)
            ds_comm.all_gather_into_tensor(full, data.contiguous(), group=self.plan.mp_group)
            data = full[:k.shape.numel()].view(k.shape)
        return data.detach().requires_grad_(k.requires_grad)
