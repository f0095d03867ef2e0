"""Upstream's `_set_fp32_optimizer_param_groups` / `_clear_fp32_optimizer_param_groups` on Stage3Optimizer.

DeepSpeed's ZeRO-3 optimizer keeps its base optimizer's param groups empty and, around a
`state_dict()` / `load_state_dict()` of it, puts each sub-group's fp32 flat partition in, so the
base optimizer's state reads as one flat per group (the layout of its `*_optim_states.pt`).
Upstream's universal-checkpoint tests read `engine.optimizer.optimizer.state_dict()` that way.

Our base optimizer holds one tensor per parameter fragment instead (stage3/optimizer.py), and a
unit's shard already holds each parameter's rank piece (ParamwisePartition), so the flat of a
param group is a re-ordering of this rank's own elements: `install` builds the flats (copies, on
the masters' device), puts them in the base optimizer as its params and state; `remove` writes the
flats and their state back into the fragments (so a `load_state_dict` or an in-place change in
between takes effect, as upstream's) and restores the base optimizer. Local: no collective.
"""

from __future__ import annotations

from typing import Any

import torch


class Fp32GroupsView:
    """The base optimizer shown in DeepSpeed's per-group flat layout until `remove()`."""

    def __init__(self, wrapper: Any) -> None:
        from ...checkpoint.hp_state import HpState
        from ..partition import ParamwisePartition

        if wrapper.swapper is not None or any(um.unit.world != wrapper.dp_world for um in wrapper.units):
            raise NotImplementedError("_set_fp32_optimizer_param_groups: not with offload_optimizer.device nvme "
                                      "or expert-parallel units (their pieces are not this rank's group slices)")
        self.hp = hp = HpState(wrapper._engine("_set_fp32_optimizer_param_groups"))
        self.base, self.rank = hp.base, wrapper.dp_rank
        self.layouts = [ParamwisePartition(tuple(s.numel() for _, s in g), wrapper.dp_world) for g in hp.groups]
        self.fields, step = hp.local_fields()
        device = wrapper.units[0].master.device if wrapper.units else wrapper._comm_device
        flats = {k: [t.to(device) for t in v] for k, v in hp.recut(["fp32"] + self.fields, self.layouts,
                                                                    self.rank).items()}
        self.saved = ([g["params"] for g in self.base.param_groups], self.base.state)
        state: dict = {}
        for g, group in enumerate(self.base.param_groups):
            flat = flats["fp32"][g]
            group["params"] = [flat]
            entry = {} if step is None else {"step": torch.tensor(float(step))}  # host: torch keeps Adam's step on CPU
            entry.update({field: flats[field][g] for field in self.fields})
            state[flat] = entry
        from collections import defaultdict

        self.base.state = defaultdict(dict, state)

    def remove(self) -> None:
        """Write the flats (values and state) back into the fragments; restore the base optimizer."""
        flats = [g["params"][0] for g in self.base.param_groups]
        state = self.base.state
        params, self.base.state = self.saved
        for group, saved in zip(self.base.param_groups, params):
            group["params"] = saved
        cuts = self.hp._cutter(self.layouts)
        with torch.no_grad():
            for piece in self.hp.pieces:
                entry = state.get(flats[piece.group], {})
                own = self.base.state[piece.key]
                for dst, g, at, n, src in cuts(piece.name, piece.start, piece.numel):
                    if dst != self.rank:
                        continue
                    piece.master[src:src + n].copy_(flats[g][at:at + n])
                    for field, value in entry.items():
                        if field == "step" or not torch.is_tensor(value) or value.dim() == 0:
                            continue
                        if field not in own:
                            own[field] = torch.zeros_like(piece.key)
                        own[field].view(-1)[src:src + n].copy_(value[at:at + n])
                if "step" in entry:
                    own["step"] = entry["step"].clone() if torch.is_tensor(entry["step"]) else entry["step"]
