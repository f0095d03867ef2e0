"""The base optimizer's own `state_dict()` at ZeRO stages 1-2, in DeepSpeed's one-flat-per-group shape.

[Note: the base optimizer's state_dict at ZeRO-1/2]
DeepSpeed's ZeRO-1/2 base optimizer steps one flat fp32 partition per param group, so
`engine.optimizer.optimizer.state_dict()` has one state entry per group whose tensors are the same
size on every rank; code that all-gathers them (upstream's universal-checkpoint tests do) relies on
that. Ours steps one tensor per parameter fragment of the rank's bucket shards (zero/optimizer.py),
so the raw form has a different number of tensors on each rank. Hooks on the base optimizer give
its `state_dict()` the flat shape and let its `load_state_dict()` take it back:

* group g's flat on rank r is rank r's master shards of every bucket holding a parameter of group
  g, back to back (each is the bucket's padded size / N: the same length on every rank), with the
  elements of group g's fragments in place and zeros elsewhere (other groups' elements, padding);
* gathered over the ranks, a group that is one bucket reads as that bucket's flat (gradient-ready
  order) with the padding at the end, as DeepSpeed's flat is with its;
* local: no collective, so a rank may call it alone. It allocates the flats (upstream returns
  its own tensors), and returns the raw form where the state is not elementwise (Adafactor's
  factored moments), where Muon or NVMe offload hold it, or before the first step.

The engine's checkpoints do not use this: they are re-cut to DeepSpeed's file layout (runtime/checkpoint).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

FLAT_MARK = "ds_shard_flats"   # in the flat form: {"state", "param_groups", FLAT_MARK: True}


class ShardFlatStateDict:
    """Hooks that present a ZeRO-1/2 base optimizer's state per group flat (see the Note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shards: list[Any], model_param_groups: list[list[Any]],
                 enabled: Callable[[], bool]) -> None:
        self.optimizer, self.shards, self.enabled = optimizer, shards, enabled
        group_of_param = {id(p): g for g, params in enumerate(model_param_groups) for p in params}
        # per group: [(offset of the shard in the flat, shard)], the shards of buckets holding its parameters
        self.layout: list[list[tuple[int, Any]]] = []
        for g in range(len(model_param_groups)):
            at, placed = 0, []
            for shard in shards:
                if any(group_of_param.get(id(p)) == g for p in shard.params):
                    placed.append((at, shard))
                    at += shard.master.numel()
            self.layout.append(placed)
        self.group_of = {id(m): group_of_param.get(id(shard.params[f.index]))
                         for shard in shards for m, f in shard.fragment_masters}
        optimizer.register_state_dict_post_hook(self._to_flats)
        optimizer.register_load_state_dict_pre_hook(self._from_flats)

    def _masters(self, g: int) -> list[tuple[int, Any, Any]]:
        """(flat offset, fragment master, fragment) of group g's fragments on this rank."""
        return [(at + f.shard_start, m, f) for at, shard in self.layout[g] for m, f in shard.fragment_masters
                if self.group_of[id(m)] == g]

    def _flat_length(self, g: int) -> int:
        return sum(shard.master.numel() for _, shard in self.layout[g])

    def _to_flats(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
        if not self.enabled() or not state_dict["state"] or len(self.layout) != len(state_dict["param_groups"]):
            return None
        index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        stepped = [(state_dict["state"].get(index[id(m)]), f.numel) for shard in self.shards
                   for m, f in shard.fragment_masters if id(m) in index]
        if not stepped or any(e is None for e, _ in stepped) or not all(
                v.numel() == n for e, n in stepped for v in e.values() if _per_element(v)):
            return None   # not elementwise (Adafactor's factored moments), or some fragment not stepped yet
        template = stepped[0][0]
        state = {}
        for g in range(len(self.layout)):
            entry = {k: v for k, v in template.items() if not _per_element(v)}   # step and other scalars
            length = self._flat_length(g)
            for field, value in template.items():
                if _per_element(value):
                    entry[field] = torch.zeros(length, dtype=value.dtype, device=value.device)
            for at, m, f in self._masters(g):
                own = state_dict["state"][index[id(m)]]
                for field, value in own.items():
                    if _per_element(value):
                        entry[field][at:at + f.numel].copy_(value.view(-1))
            state[g] = entry
        groups = [{**group, "params": [g]} for g, group in enumerate(state_dict["param_groups"])]
        return {"state": state, "param_groups": groups, FLAT_MARK: True}

    def _from_flats(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
        if not state_dict.get(FLAT_MARK):
            return None   # the raw per-fragment form (the engine's checkpoint loader hands that in)
        if len(state_dict["param_groups"]) != len(self.layout):
            raise ValueError(f"load_state_dict: the state_dict has {len(state_dict['param_groups'])} param "
                             f"groups, this optimizer {len(self.layout)}")
        state, groups, index = {}, [], 0
        for g, (group, saved) in enumerate(zip(optimizer.param_groups, state_dict["param_groups"])):
            where = {id(m): (at, f) for at, m, f in self._masters(g)}
            entry = state_dict["state"].get(saved["params"][0], {})
            for field, value in entry.items():
                if _per_element(value) and value.numel() != self._flat_length(g):
                    raise ValueError(f"load_state_dict: param group {g}'s {field!r} has {value.numel()} "
                                     f"elements, this rank's flat {self._flat_length(g)}: it was taken at "
                                     "another world size or bucket size; load ZeRO optimizer state across "
                                     "layouts with engine.load_checkpoint")
            for m in group["params"]:
                at, f = where[id(m)]
                if entry:
                    state[index] = {k: v[at:at + f.numel].view_as(m).clone() if _per_element(v)
                                    else (v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()}
                index += 1
            groups.append({**saved, "params": list(range(index - len(group["params"]), index))})
        return {"state": state, "param_groups": groups}


def _per_element(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0
