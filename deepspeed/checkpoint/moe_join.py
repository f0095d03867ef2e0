"""The named pieces of a MoE-layout tag, indexed once and joined one parameter at a time.

[Note: joining a MoE-layout tag per parameter]
A MoE-layout tag ([Note: MoE checkpoint layout] in runtime/checkpoint/moe_io.py; with tensor parallelism one
file set per tensor rank, [Note: EP x TP checkpoint layout] in runtime/checkpoint/ep_tp_io.py) keeps each
rank's optimizer as named pieces (`ds_moe_pieces`: global name, offset into the whole tensor, fp32 master and
every optimizer field). `MoEIndex` is the plan: every optimizer file loaded memory-mapped (files.load_file)
and its pieces indexed by parameter (which file, start, numel, the piece tensors, which stay in the mapping),
and everything a join could refuse checked from the index alone before anything is joined or written (foreign
files, disagreeing shapes, incomplete parameters, a sliced parameter missing from a tensor rank's files,
different steps). `MoEIndex.join` is the executor: one field of one parameter, its pieces copied out of the
mappings (their pages given back as they go, [Note: released reads]) and, for a tensor-sliced parameter, its
tensor ranks' slices joined along its partition dim (zero_to_fp32.join_tp_slices, fused weights block by
block). ds_to_universal writes parameter by parameter and load_checkpoint's JoinedReader joins a field when
the loader first asks for it (checkpoint/moe_to_universal.py), so neither holds more than one parameter's
values beyond the mapped files.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from .constants import EP_TP_LAYOUT_KEY, FOLDING_METADATA_KEY
from .files import CheckpointError, expert_file, load_file, model_file
from .mapped import copy_released, mapping_of

PIECES = "ds_moe_pieces"   # runtime/checkpoint/moe_io.py writes them


def optimizer_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "expp_rank_*_optim_states.pt")) +
                  glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt")))


def megatron_dims(where: str, states: dict) -> dict[str, int]:
    """{name: partition dim} of the Megatron-style tensor layers the model states tag; a tag without a
    usable dim is refused (its slices cannot be joined)."""
    from ..runtime.checkpoint.writer import MEGATRON_TP_DIMS

    tagged = states.get(MEGATRON_TP_DIMS) or {}
    undescribed = sorted(n for n, d in tagged.items() if d is None)
    if undescribed:
        raise CheckpointError(f"{where}: tensor-parallel parameters {undescribed} carry no partition_dim "
                              "(or a partition_stride other than 1); cannot join their slices")
    return dict(tagged)


def _tensor_dims(where: str, models: dict[int, dict]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The tensor-sliced parameters of an EP x TP tag, from its model states: AutoTP's `tp_partition_dims`
    (fused `tp_sub_param_sizes`) and the `partition_dim` of Megatron-style layers."""
    dims, blocks = {}, {}
    for states in models.values():
        if (states.get(EP_TP_LAYOUT_KEY) or {}).get("expert_tensor_parallel"):
            raise CheckpointError(f"{where}: its experts are sliced over the tensor ranks (MoE "
                                  "enable_expert_tensor_parallelism); ds_to_universal does not join them")
        dims.update(megatron_dims(where, states))
        dims.update(states.get("tp_partition_dims") or {})
        blocks.update(states.get("tp_sub_param_sizes") or {})
    return dims, blocks


def _covered(spans: list[tuple[int, int]]) -> int:
    """How many elements the [start, start+numel) spans cover together (pieces may repeat: stage-0 files)."""
    total, end = 0, 0
    for start, numel in sorted(spans):
        lo, hi = max(start, end), start + numel
        if hi > lo:
            total, end = total + hi - lo, hi
    return total


class MoEIndex:
    """The MoE-layout tag `folder` indexed ([Note: joining a MoE-layout tag per parameter]): `names` (every
    trained parameter), `shapes` (whole), `fields(name)`, `join(name, field)` (a new flat fp32 tensor),
    `steps`, `param_groups`, `loss_scaler`, `cat_dims`, `expert_files`, `models` (each tensor rank's model
    states, memory-mapped)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        sets = sorted(int(m.group(1)) for m in map(re.compile(r"mp_rank_(\d+)_model_states\.pt$").match,
                                                   os.listdir(folder)) if m)
        if sets != list(range(len(sets))):
            raise CheckpointError(f"{folder}: model-states files of tensor ranks {sets}; expected "
                                  f"{model_file()} .. mp_rank_<tp-1> (one per tensor rank)")
        self.sets = sets
        self.models = {t: load_file(os.path.join(folder, model_file(t))) for t in sets}
        self.dims, self.blocks = _tensor_dims(folder, self.models) if len(sets) > 1 else ({}, {})
        found = optimizer_files(folder)
        if not found:
            raise CheckpointError(f"{folder}: an MoE checkpoint without optimizer files has nothing to convert "
                                  "(its per-expert files load at any ep_size as they are)")
        loaded = [load_file(f) for f in found]
        self.mappings = [m for m in (mapping_of(f, s) for f, s in zip(found, loaded)) if m is not None]
        loaded = [s.get("optimizer_state_dict", s) for s in loaded]
        foreign = [os.path.basename(f) for f, s in zip(found, loaded) if PIECES not in s]
        if foreign:
            raise CheckpointError(f"{folder}: {foreign} hold no named pieces ({PIECES}): an MoE checkpoint "
                                  "written by DeepSpeed itself; convert it with DeepSpeed's ds_to_universal")
        tensor_rank = [int(m.group(1)) if m else 0 for m in (re.search(r"_mp_rank_(\d+)_", os.path.basename(f))
                                                              for f in found)]
        steps = {s["step"] for s in loaded if s.get("step") is not None}
        if len(steps) > 1:
            raise CheckpointError(f"{folder}: the optimizer files record different steps {sorted(steps)}")
        self.steps = steps
        first = loaded[tensor_rank.index(0)] if 0 in tensor_rank else loaded[0]
        self.param_groups, self.loss_scaler = first["param_groups"], first.get("loss_scaler")
        # (tensor rank or None, name) -> [(start, numel, {field: piece})], in the order the values are laid
        # down: tensor rank 0's files last, so where sets overlap (replicated parameters) its values are kept
        self._pieces: dict[tuple, list[tuple[int, int, dict]]] = {}
        self._shapes: dict[tuple, tuple] = {}
        for t, state in sorted(zip(tensor_rank, loaded), key=lambda pair: -pair[0]):
            for name, start, numel, pieces in state[PIECES]:
                key = (t if name in self.dims else None, name)
                shape = tuple(state["shapes"][name])
                if self._shapes.setdefault(key, shape) != shape:
                    raise CheckpointError(f"{folder}: {name!r} has shape {shape} on tensor rank {t} and "
                                          f"{self._shapes[key]} on another, but no tensor-parallel dim is recorded "
                                          "for it")
                self._pieces.setdefault(key, []).append((int(start), int(numel), pieces))
        self._check()

    def _check(self) -> None:
        """Everything `join` could refuse, from the index: each (tensor rank's) parameter covered by its
        pieces, each sliced parameter's fields in every tensor rank's files."""
        self._fields: dict[tuple, list[str]] = {}
        for key, entries in self._pieces.items():
            size = torch.Size(self._shapes[key]).numel()
            have = _covered([(start, numel) for start, numel, _ in entries])
            if have != size:
                where = "" if key[0] is None else f" (tensor rank {key[0]})"
                raise CheckpointError(f"{self.folder}: parameter {key[1]!r}{where} is incomplete in the optimizer "
                                      f"files ({have} of {size} elements): a rank's file is missing")
            self._fields[key] = list(dict.fromkeys(f for _, _, pieces in entries for f in pieces))
        self.shapes: dict[str, tuple] = {name: shape for (t, name), shape in self._shapes.items() if t is None}
        self.cat_dims: dict[str, int] = {}
        for name in sorted({n for t, n in self._pieces if t is not None}):
            for field in dict.fromkeys(f for t in self.sets for f in self._fields.get((t, name), ())):
                missing = [t for t in self.sets if field not in self._fields.get((t, name), ())]
                if missing:
                    raise CheckpointError(f"{self.folder}: parameter {name!r} ({field}) is missing from the files "
                                          f"of tensor ranks {missing}")
            # join_tp_slices concatenates along the dim (fused weights block by block: the same total)
            dim, first = self.dims[name], self._shapes[(self.sets[0], name)]
            self.shapes[name] = (*first[:dim], sum(self._shapes[(t, name)][dim] for t in self.sets), *first[dim + 1:])
            if not self.blocks.get(name):
                self.cat_dims[name] = self.dims[name]
        self.names = sorted(self.shapes)

    def fields(self, name: str) -> list[str]:
        """The fields ("fp32", "exp_avg", ...) the files hold for `name` (in the order they were saved)."""
        key = (None, name) if (None, name) in self._fields else (self.sets[0], name)
        return list(self._fields.get(key, ()))

    def join(self, name: str, field: str) -> torch.Tensor | None:
        """`field` of parameter `name` whole (flat fp32, a new tensor), out of the mapped pieces; None when the
        files hold no such field for it."""
        if field not in self.fields(name):
            return None
        if (None, name) in self._pieces:
            return self._flat((None, name), field)
        slices = [self._flat((t, name), field).view(self._shapes[(t, name)]) for t in self.sets]
        return self._join_slices(name, slices).reshape(-1)

    def _flat(self, key: tuple, field: str) -> torch.Tensor:
        out = torch.zeros(torch.Size(self._shapes[key]).numel(), dtype=torch.float32)   # host: offline join
        for start, numel, pieces in self._pieces[key]:
            if field in pieces:
                copy_released(out[start:start + numel], pieces[field].reshape(-1), self.mappings)
        return out

    def _join_slices(self, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
        from ..utils.zero_to_fp32 import join_tp_slices

        return join_tp_slices(slices, self.dims[name], self.blocks.get(name))

    def whole_model_states(self, skip: frozenset = frozenset()) -> dict:
        """Tensor rank 0's model states as one tensor set: sliced module entries (except `skip`) whole,
        `mp_world_size` 1, and without the records of the saved tensor layout (a universal checkpoint has no
        tensor ranks); `skip`ped sliced entries are left out."""
        states = {k: v for k, v in self.models[0].items() if k not in (EP_TP_LAYOUT_KEY, FOLDING_METADATA_KEY)}
        if len(self.models) == 1:
            return states
        module = {}
        for name, value in (states.get("module") or {}).items():
            if name not in self.dims:
                module[name] = value
            elif name not in skip:
                module[name] = self._join_slices(name, [self.models[t]["module"][name] for t in self.sets])
        return dict(states, module=module, mp_world_size=1)

    def expert_files(self) -> dict[str, str]:
        """{`layer_L_expert_E_mp_rank_00_...`: the saved file}: one per expert, from the lowest tensor rank
        holding it (with an mpu each tensor rank holds a copy; folded AutoEP, one of them)."""
        out = {}
        for source in sorted(glob.glob(os.path.join(self.folder, "layer_*_expert_*_model_states.pt")), reverse=True):
            match = re.match(r"layer_(\d+)_expert_(\d+)_mp_rank_\d+_model_states\.pt$", os.path.basename(source))
            if match:
                out[expert_file(int(match.group(1)), int(match.group(2)))] = source
        return out

    def values(self, name: str) -> Any:
        """(field, flat whole value) of each field of `name`, joined one at a time as the caller iterates."""
        for field in self.fields(name):
            yield field, self.join(name, field)
