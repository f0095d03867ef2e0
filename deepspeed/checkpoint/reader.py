"""Read any DeepSpeed-layout checkpoint as full per-parameter values, whatever wrote it.

[Note: resume anywhere]
A checkpoint tag holds the fp32 master weights and the optimizer state in one of a few layouts:
replicated (stage 0 fp32: the module weights plus a torch optimizer state_dict), flat
partitions of each param group across N ranks (ZeRO-1/2, and the bf16 optimizer at stage 0),
per-parameter partitions (ZeRO-3), or one directory per parameter (universal). The reader maps
every layout to one question, "elements [start, start+numel) of parameter `name`, field `f`"
(`f` is "fp32" or an optimizer state such as "exp_avg"), answered by copying out of the
memory-mapped files of the ranks that hold them. The loader asks it for exactly the slices its
own rank owns, so a checkpoint saved by N ranks at stage s loads on M ranks at stage s' with no
conversion step and without materialising the whole model on any rank.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from ..runtime.zero.partition import BucketPartition, ParamwisePartition
from .files import CheckpointError, load_file, model_file, tag_dir, wait_for_background_saves

ALIGNMENT = 2  # DeepSpeed pads each ZeRO-1/2 param group to a multiple of 2 * world size


def is_universal(path: str) -> bool:
    """A tag directory in the universal layout: zero/<param>/ folders and no ZeRO optimizer-state files."""
    return os.path.isdir(os.path.join(path, "zero")) and \
        not glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_*_optim_states.pt"))


class CheckpointReader:
    """One tag of a checkpoint directory; see [Note: resume anywhere]."""

    def __init__(self, load_dir: str, tag: str, mp_rank: int = 0, module_state: dict | None = None) -> None:
        wait_for_background_saves()
        path = tag_dir(load_dir, tag)
        if path is None:
            raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (no directory {tag})")
        self.path, self.tag, self.mp_rank = path, tag, mp_rank   # mp_rank: a pipeline stage's files
        self.universal = os.path.isdir(os.path.join(path, "zero")) and not self._optim_files()
        model_path = os.path.join(path, model_file(mp_rank))
        zero3_model = os.path.join(path, model_file(mp_rank, zero3_dp_rank=0))
        if os.path.isfile(model_path):
            self.model_states = load_file(model_path)
        elif os.path.isfile(zero3_model):
            self.model_states = load_file(zero3_model)
        else:
            raise CheckpointError(f"{path}: no {model_file()} (nor {model_file(zero3_dp_rank=0)}); not a "
                                  "DeepSpeed checkpoint tag directory")
        if module_state is not None:   # pipelines keep the module in per-layer files (runtime/pipe/checkpoint.py)
            self.model_states["module"] = module_state
        self.rank_files = self._optim_files()
        if self.rank_files:
            self._check_rank_count(load_file(self.rank_files[0]))
        self.zero_states = [load_file(f) for f in self.rank_files]
        self.optimizer_state = [s["optimizer_state_dict"] for s in self.zero_states]
        self.stage = self._stage()
        # optimizer-wide state (loss scaler, clip_grad, ...): rank 0's, or the universal common file
        self.common_state: dict = self.optimizer_state[0] if self.optimizer_state else {}
        self._full: dict[str, dict[str, torch.Tensor]] = {}   # replicated layouts: field -> name -> tensor
        self._groups: list[list[tuple[str, torch.Size]]] = []
        self._where: dict[str, tuple[int, int]] = {}           # name -> (group, index)
        self._partitions: list[Any] = []
        self._fragment_cache: dict[tuple[int, int], dict[int, list]] = {}
        self._parts: dict[str, list[list[torch.Tensor]]] = {}  # field -> group -> rank -> flat
        if self.universal:
            self._init_universal()
        elif self.optimizer_state:
            self._init_partitioned()
        else:
            self._init_replicated()

    # --- what is there ----------------------------------------------------------------------
    def _optim_files(self) -> list[str]:
        mp = f"{self.mp_rank:02d}"
        found = glob.glob(os.path.join(self.path, f"*zero_pp_rank_*_mp_rank_{mp}_optim_states.pt"))
        by_rank = {}
        for name in found:
            match = re.search(rf"zero_pp_rank_(\d+)_mp_rank_{mp}_optim_states\.pt$", name)
            by_rank[int(match.group(1))] = name
        ranks = sorted(by_rank)
        if ranks and ranks != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise CheckpointError(f"{self.path}: optimizer-state files of ranks {missing} are missing "
                                  f"(found ranks {ranks})")
        return [by_rank[r] for r in ranks]

    def _check_rank_count(self, first: dict) -> None:
        count = first.get("optimizer_state_dict", {}).get("partition_count")
        if count is None:
            return
        expected = int(count[0] if isinstance(count, (list, tuple)) else count)
        if expected != len(self.rank_files):
            prefix = os.path.basename(self.rank_files[0]).split("zero_pp_rank_")[0]
            missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_{self.mp_rank:02d}_optim_states.pt"
                       for r in range(expected) if r >= len(self.rank_files)]
            raise CheckpointError(f"{self.path}: written by {expected} ranks but {len(self.rank_files)} "
                                  f"optimizer-state files are present; missing ranks "
                                  f"{list(range(len(self.rank_files), expected))}: {missing}")

    def _stage(self) -> int:
        if not self.optimizer_state:
            return 0
        stage = self.optimizer_state[0].get("zero_stage")
        if stage is None:
            return 0  # the bf16 optimizer of stage 0 partitions like ZeRO-1 but has no zero_stage
        return int(stage)

    @property
    def world_size(self) -> int:
        if self.optimizer_state:
            count = self.optimizer_state[0].get("partition_count")
            expected = int(count[0] if isinstance(count, (list, tuple)) else count) if count is not None \
                else len(self.optimizer_state)
            if expected != len(self.optimizer_state):
                raise CheckpointError(f"{self.path}: written by {expected} ranks but only {len(self.optimizer_state)}"
                                      " optimizer-state files are present")
            return expected
        return int(self.model_states.get("dp_world_size", 1) or 1)

    def param_names(self) -> list[str]:
        return [n for g in self._groups for n, _ in g]

    def groups(self) -> list[list[tuple[str, torch.Size]]]:
        return self._groups

    def has(self, name: str) -> bool:
        return name in self._where

    def has_field(self, name: str, field: str) -> bool:
        """Whether a replicated or universal checkpoint holds `field` for parameter `name`."""
        return name in self._full.get(field, {})

    def fields(self) -> list[str]:
        return sorted(f for f in self._parts if f != "fp32") if self._parts else \
            sorted(f for f in self._full if f != "fp32")

    # --- layouts ----------------------------------------------------------------------------
    def _init_partitioned(self) -> None:
        shapes = self.model_states.get("param_shapes")
        if shapes is None:
            raise CheckpointError(f"{self.path}: {model_file()} has no 'param_shapes'; cannot map the flat "
                                  "optimizer partitions to parameter names")
        if isinstance(shapes, dict):
            shapes = [shapes]
        world = self.world_size
        if self.stage == 3:  # all groups share one per-parameter walk of each rank's flat
            shapes = [{n: s for g in shapes for n, s in g.items()}]
        self._set_groups(shapes)
        for g, group in enumerate(self._groups):
            numels = tuple(int(torch.Size(s).numel()) for _, s in group)
            self._partitions.append(ParamwisePartition(numels, world) if self.stage == 3
                                    else BucketPartition(numels, world, ALIGNMENT))
        for rank, state in enumerate(self.optimizer_state):
            if self.stage == 3:
                fp32 = [_joined(state["fp32_flat_groups"])]
                base = state["optimizer_state_dict"]["state"]
                per_field = self._concat_state([base[k] for k in sorted(base)])
            else:
                fp32 = list(state["single_partition_of_fp32_groups"])
                base = state["base_optimizer_state"]
                groups = [base["state"][k] for k in sorted(base["state"])] if isinstance(base, dict) else list(base)
                per_field = {f: [gs[f].reshape(-1) for gs in groups] for f in self._tensor_fields(groups)}
                self._step = self._find_step(groups, state)
            self._add_parts("fp32", rank, fp32)
            for field, parts in per_field.items():
                self._add_parts(field, rank, parts)
        if self.stage == 3:
            base = self.optimizer_state[0]["optimizer_state_dict"]
            self._step = self._find_step([base["state"][k] for k in sorted(base["state"])], {})
        self.param_groups = self._base_param_groups()

    def _concat_state(self, groups: list[dict]) -> dict[str, list[torch.Tensor]]:
        return {f: [_joined([g[f] for g in groups])] for f in self._tensor_fields(groups)}

    @staticmethod
    def _tensor_fields(groups: list[dict]) -> list[str]:
        if not groups:
            return []
        return [k for k, v in groups[0].items() if torch.is_tensor(v) and v.dim() > 0]

    @staticmethod
    def _find_step(groups: list[dict], state: dict) -> Any:
        for g in groups:
            if "step" in g:
                return float(g["step"])
        return state.get("base_optimizer_state_step")

    def _add_parts(self, field: str, rank: int, parts: list[torch.Tensor]) -> None:
        table = self._parts.setdefault(field, [[None] * len(self.optimizer_state) for _ in self._groups])
        for g, part in enumerate(parts):
            table[g][rank] = part.reshape(-1)

    def _set_groups(self, shapes: list[dict]) -> None:
        self._groups = [[(n, torch.Size(s)) for n, s in g.items()] for g in shapes]
        self._where = {n: (g, i) for g, group in enumerate(self._groups) for i, (n, _) in enumerate(group)}

    def _base_param_groups(self) -> list[dict]:
        state = self.optimizer_state[0]
        base = state.get("base_optimizer_state") if self.stage != 3 else state.get("optimizer_state_dict")
        if isinstance(base, dict) and "param_groups" in base:
            return [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
        return []

    def _init_replicated(self) -> None:
        module = self.model_states["module"]
        optimizer = self.model_states.get("optimizer") or {}
        names = self.model_states.get("optimizer_param_names")
        # DeepSpeed's stage-0 mixed-precision optimizer (FP16_UnfusedOptimizer, used for bf16)
        # nests the torch state_dict and keeps the fp32 masters per group in `fp32_groups`.
        self._fp32_groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
        if isinstance(optimizer, dict) and "optimizer_state_dict" in optimizer:
            self.common_state = {k: v for k, v in optimizer.items() if k not in ("optimizer_state_dict", "fp32_groups")}
            optimizer = optimizer["optimizer_state_dict"]
        torch_state = optimizer.get("state", {}) if isinstance(optimizer, dict) else {}
        groups = optimizer.get("param_groups", []) if isinstance(optimizer, dict) else []
        self._full["fp32"] = {n: t for n, t in module.items()}
        self._replicated_names = names
        self._torch_state, self._torch_groups = torch_state, groups
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._step = None
        for state in torch_state.values():
            if "step" in state:
                self._step = float(state["step"])
                break

    def bind_replicated_names(self, optimizer_names: list[list[str]], trainable: set[str],
                              strict: bool = True) -> None:
        """Stage-0 checkpoints key optimizer state by position: name the positions.

        Our own files record the names (`optimizer_param_names`); DeepSpeed's do not, so the
        loading engine's optimizer groups name them (they must list the same parameters). When
        they do not and `strict` is False, the weights are still read by name from the module
        state, without optimizer state."""
        if not (self.optimizer_state == [] and not self.universal):
            return
        names = self._replicated_names or optimizer_names
        module = self._full["fp32"]
        shapes = []
        for g, group in enumerate(self._torch_groups or [[]]):
            indices = group["params"] if isinstance(group, dict) else []
            group_names = names[g] if g < len(names) else []
            if len(indices) != len(group_names) and not strict and self._replicated_names is None:
                self._torch_groups, self._torch_state, self.param_groups, self._step = [], {}, [], None
                for f in [f for f in self._full if f != "fp32"]:
                    del self._full[f]
                shapes = []
                break
            if len(indices) != len(group_names):
                raise CheckpointError(f"{self.path}: optimizer param group {g} has {len(indices)} parameters in the "
                                      f"checkpoint but {len(group_names)} in this engine's optimizer")
            for j, (index, name) in enumerate(zip(indices, group_names)):
                if self._fp32_groups is not None:
                    module[name] = self._fp32_groups[g][j]
                for field, value in self._torch_state.get(index, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        self._full.setdefault(field, {})[name] = value
            shapes.append({n: module[n].shape for n in group_names if n in module and n in trainable})
        if not self._torch_groups:
            shapes = [{n: t.shape for n, t in module.items() if n in trainable}]
        self._set_groups(shapes)

    def _init_universal(self) -> None:
        root = os.path.join(self.path, "zero")
        shapes, full = {}, {}
        self._step = None
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            if not os.path.isdir(folder):
                continue
            for entry in os.listdir(folder):
                if not entry.endswith(".pt"):
                    continue
                field = entry[:-3]
                value = load_file(os.path.join(folder, entry))
                value = value.get("param", value) if isinstance(value, dict) else value
                if field == "step":
                    self._step = float(value)
                    continue
                full.setdefault(field, {})[name] = value
            if name not in full.get("fp32", {}):
                raise CheckpointError(f"{folder} has no fp32.pt: every parameter folder of a universal checkpoint "
                                      f"holds its fp32 weight ({{'param': tensor}}) beside its optimizer state files "
                                      f"(found {sorted(os.listdir(folder))})")
            shapes[name] = full["fp32"][name].shape
        self._full = full
        # DeepSpeed also writes fp32.pt for buffers and frozen parameters: the trained ones are those
        # of param_shapes (or, without it, those with optimizer state)
        trained = {n for g in (self.model_states.get("param_shapes") or []) for n in g} or \
            {n for f, values in full.items() if f != "fp32" for n in values}
        shapes = {n: s for n, s in shapes.items() if n in trained}
        self._set_groups([shapes])
        self.param_groups = []
        optimizer_state = os.path.join(self.path, "zero", "optimizer_state.pt")
        if os.path.isfile(optimizer_state):
            self.common_state = load_file(optimizer_state)
            self.param_groups = [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.common_state.get("param_groups", [])]

    # --- reading ----------------------------------------------------------------------------
    @property
    def step(self) -> Any:
        return self._step

    def has_field(self, name: str, field: str) -> bool:
        """Whether `read(name, field)` gives values (rather than None), without reading them."""
        if self._full or field not in self._parts:
            return self._full.get(field, {}).get(name) is not None
        return name in self._where

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        """Elements [start, start+numel) of parameter `name`'s flattened `field`, as fp32 (a new tensor);
        None when the checkpoint has no such field for it."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no parameter named {name!r} in the checkpoint")
        g, i = self._where[name]
        total = self._groups[g][i][1].numel()
        numel = total - start if numel is None else numel
        if self._full or field not in self._parts:
            value = self._full.get(field, {}).get(name)
            return None if value is None else value.reshape(-1)[start:start + numel].float().clone()
        out = torch.empty(numel, dtype=torch.float32)  # host: read from files, copied by the caller
        parts = self._parts[field][g]
        filled = 0
        for rank, part in enumerate(parts):
            for frag in self._fragments(g, rank).get(i, ()):
                lo, hi = max(start, frag.param_start), min(start + numel, frag.param_start + frag.numel)
                if lo < hi:
                    src = frag.shard_start + lo - frag.param_start
                    out[lo - start:hi - start].copy_(part[src:src + hi - lo])
                    filled += hi - lo
        if filled != numel:
            raise CheckpointError(f"{self.path}: parameter {name!r} ({field}) is incomplete in the checkpoint: "
                                  f"found {filled} of {numel} elements")
        return out

    def _fragments(self, group: int, rank: int) -> dict[int, list]:
        """{parameter index: its fragments in `rank`'s partition of `group`} (cached)."""
        key = (group, rank)
        if key not in self._fragment_cache:
            table: dict[int, list] = {}
            for frag in self._partitions[group].fragments(rank):
                table.setdefault(frag.index, []).append(frag)
            self._fragment_cache[key] = table
        return self._fragment_cache[key]

    def module_tensor(self, name: str) -> torch.Tensor | None:
        """A module state-dict entry (buffer or frozen parameter), full size, or None."""
        value = (self.model_states.get("module") or {}).get(name)
        if value is not None and value.numel() > 0:
            return value
        if self.stage == 3:
            return self._zero3_frozen(name)
        fragments = self.model_states.get("frozen_param_fragments") or {}
        if name in fragments:
            return fragments[name]
        return self._full.get("fp32", {}).get(name) if self.universal else None

    def _zero3_frozen(self, name: str) -> torch.Tensor | None:
        """ZeRO-3 keeps each rank's slice of a frozen parameter in that rank's model-states file."""
        shape = (self.model_states.get("frozen_param_shapes") or {}).get(name)
        if shape is None:
            return None
        pieces = []
        for rank in range(len(self.rank_files)):
            states = self.model_states if rank == 0 else load_file(os.path.join(self.path,
                                                                                model_file(self.mp_rank, zero3_dp_rank=rank)))
            pieces.append(states["frozen_param_fragments"][name].reshape(-1))
        numel = torch.Size(shape).numel()
        return torch.cat(pieces)[:numel].view(shape)  # slices of ceil(numel/N), the last zero-padded


class _Joined:
    """One rank's per-group flats read as one (a stage-3 file's per-parameter walk spans its groups)
    without concatenating them: the memory-mapped files are read only where sliced, and a slice copies
    only when it crosses from one group's flat into the next."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts, self.starts, at = parts, [], 0
        for part in parts:
            self.starts.append(at)
            at += part.numel()
        self._numel = at

    def numel(self) -> int:
        return self._numel

    def reshape(self, *shape: Any) -> "_Joined":
        return self

    def __getitem__(self, where: slice) -> torch.Tensor:
        lo, hi, _ = where.indices(self._numel)
        pieces = [part[max(lo - start, 0):min(hi - start, part.numel())]
                  for part, start in zip(self.parts, self.starts) if start < hi and start + part.numel() > lo]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.zeros(0, device="cpu")   # host: an empty read


def _joined(parts: list[torch.Tensor]) -> Any:
    """`parts` (1-D or not) as one flat: the tensor itself when there is one, else a `_Joined`."""
    flats = [t.reshape(-1) for t in parts]
    return flats[0] if len(flats) == 1 else _Joined(flats)
