"""The engine's high-precision training state, as checkpoints see it: one piece per parameter slice.

Three optimizer arrangements hold that state differently (see optimizer_wrapper.py): the bare
torch optimizer (stage 0 fp32: the parameters are the masters), MixedPrecisionOptimizer (stage
0 fp16/bf16: a full fp32 master per parameter) and ZeroOptimizer (stages 1-2: this rank's
fragments of per-bucket fp32 shards). `HpState` flattens all three into `pieces`: for each
slice of a trainable parameter this rank holds, its name, offset, fp32 master view and the
tensor its base-optimizer state is keyed by. Saving and loading work on pieces only, which is
what lets any stage and world size load what any other wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ... import comm as ds_comm


@dataclass
class Piece:
    name: str
    group: int             # index of the optimizer param group
    start: int             # offset inside the flattened parameter
    numel: int
    master: torch.Tensor   # 1-D view of the fp32 (master) values
    key: torch.Tensor      # what the base optimizer's state is keyed by


class HpState:
    """This rank's pieces plus the layout every rank agrees on (groups of (name, shape))."""

    def __init__(self, engine: Any) -> None:
        from ..precision.mixed_optimizer import MixedPrecisionOptimizer
        from ..zero.optimizer import ZeroOptimizer

        wrapper = engine.optimizer
        self.wrapper = wrapper
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        self.zero = isinstance(wrapper, ZeroOptimizer)
        self.mixed = isinstance(wrapper, MixedPrecisionOptimizer)
        self.base: torch.optim.Optimizer = wrapper.optimizer if (self.zero or self.mixed) else wrapper
        all_groups = wrapper.model_param_groups if (self.zero or self.mixed) else \
            [list(g["params"]) for g in self.base.param_groups]
        # every parameter the optimizer was given, frozen ones included (torch state_dict indices)
        self.optimizer_names = [[self.names[id(p)] for p in g] for g in all_groups]
        model_groups = [[p for p in g if p.requires_grad] for g in all_groups]
        self.groups = [[(self.names[id(p)], p.shape) for p in g] for g in model_groups]
        self.pieces: list[Piece] = []
        group_of = {id(p): i for i, g in enumerate(model_groups) for p in g}
        if self.zero:
            for sb in wrapper.buckets:
                for f in sb.fragments:
                    p = sb.params[f.index]
                    key = wrapper._fragments_of[id(p)][0]
                    self.pieces.append(Piece(self.names[id(p)], group_of[id(p)], f.param_start, f.numel,
                                             sb.master[f.shard_start:f.shard_start + f.numel], key))
        else:
            masters = {id(p): m for p, m in getattr(wrapper, "_pairs", [])}
            for i, (g, base_group) in enumerate(zip(model_groups, self.base.param_groups)):
                keys = {id(k): k for k in base_group["params"]}
                for p in g:
                    master = masters.get(id(p), p)
                    assert id(master) in keys, "optimizer param groups changed after initialize"
                    self.pieces.append(Piece(self.names[id(p)], i, 0, p.numel(), master.data.view(-1), master))

    # --- values -----------------------------------------------------------------------------
    def state_value(self, piece: Piece, field: str) -> torch.Tensor | None:
        value = self.base.state.get(piece.key, {}).get(field)
        if torch.is_tensor(value) and value.numel() == piece.numel and value.dim() > 0:
            return value.reshape(-1)
        return None

    def local_fields(self) -> tuple[list[str], Any]:
        """(sorted per-element state fields, the step count) present on this rank."""
        fields, step = set(), None
        for piece in self.pieces:
            for key, value in self.base.state.get(piece.key, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.numel:
                    fields.add(key)
                elif key == "step":
                    step = float(value) if torch.is_tensor(value) else value
        return sorted(fields), step

    def agreed_fields(self, group: Any) -> tuple[list[str], Any]:
        """The fields and step of every rank (a rank may hold no piece at all)."""
        mine = self.local_fields()
        if not self.zero or ds_comm.get_world_size(group) == 1:
            return mine
        everyone: list[Any] = [None] * ds_comm.get_world_size(group)
        ds_comm.all_gather_object(everyone, mine, group=group)
        fields = sorted({f for fs, _ in everyone for f in fs})
        steps = {s for _, s in everyone if s is not None}
        return fields, (steps.pop() if steps else None)

    def full_values(self, field: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full flattened fp32 values) of every trainable parameter, for the master
        (`field="fp32"`) or a base-optimizer state. Collective under ZeRO: one all-gather per
        bucket, so at most one bucket beyond the caller's own buffers is alive."""
        if not self.zero:
            for piece in self.pieces:
                value = piece.master if field == "fp32" else self.state_value(piece, field)
                if value is not None:
                    yield piece.name, value.float()
            return
        wrapper = self.wrapper
        for sb in wrapper.buckets:
            device = sb.param_flat.device
            if field == "fp32":
                shard = sb.master.to(device=device, dtype=torch.float32)
            else:
                shard = torch.zeros(sb.partition.shard_numel, dtype=torch.float32, device=device)
                for f in sb.fragments:
                    value = self.base.state.get(wrapper._fragments_of[id(sb.params[f.index])][0], {}).get(field)
                    if torch.is_tensor(value) and value.numel() == f.numel:
                        shard[f.shard_start:f.shard_start + f.numel].copy_(value.reshape(-1))
            full = torch.empty(sb.partition.padded_numel, dtype=torch.float32, device=device)
            if wrapper.dp_world > 1:
                ds_comm.all_gather_into_tensor(full, shard, group=wrapper.group)
            else:
                full.copy_(shard)
            for p, start in zip(sb.params, sb.partition.offsets()):
                yield self.names[id(p)], full[start:start + p.numel()]

    # --- writing back -------------------------------------------------------------------------
    def refresh_model(self) -> None:
        """Copy the masters into the model's parameters after they were loaded."""
        if self.zero:
            self.wrapper._all_gather_params()
        elif self.mixed:
            pairs = self.wrapper._pairs
            if pairs:
                torch._foreach_copy_([p.data for p, _ in pairs], [m.data for _, m in pairs])
