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

[Note: reading only what a rank needs]
No optimizer-state file is opened up front. What the files hold is a `Description` built from the
model-states file alone ([Note: a checkpoint describes itself]: its `ds_layout`, else derived from
`param_shapes`, the number of optimizer-state files (a glob) and whether the tag has per-rank
model-states files (ZeRO-3)), so its plan (`sources`, pure) says which saved ranks hold elements
[start, start+numel) of a parameter, and a rank's file is opened (and unpickled, once, its recorded
fragments checked against the Description) when a slice of it is first asked for. What every rank's
file holds alike (ZeRO stage, rank count, param groups, step, loss scaler) comes from the first file
opened, checked against the glob, else from `own_rank`'s. A ZeRO-3 rank at the same layout thus opens
its own optimizer-state and model-states files only; a ZeRO-1/2 rank the saved shards its bucket slices
lie in (this runtime's buckets run in reverse parameter order, the files in parameter order: a few
files, not N); at another layout, only the saved ranks whose shards overlap its slices
(tests/distributed/test_checkpoint_reads.py counts them).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from .description import FRAGMENTS_KEY, LAYOUT_KEY, PARAMWISE, Description, Read
from .files import CheckpointError, load_file, model_file, tag_dir, wait_for_background_saves
from .mapped import Mapping, copy_released, mapping_of
from .rank_files import OptimizerStates, RankFiles, joined


def _entries(state: Any) -> list:
    """A torch optimizer `state` in key order: a dict {index: entry}, or (a ZeRO-3 file's sub-groups) a list."""
    return [state[k] for k in sorted(state)] if isinstance(state, dict) else list(state)


def is_universal(path: str) -> bool:
    """A tag directory in the universal layout: zero/<param>/ folders and no ZeRO optimizer-state files."""
    return os.path.isdir(os.path.join(path, "zero")) and \
        not glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_*_optim_states.pt"))


def checks_then_copies(reader: Any) -> bool:
    """Whether `reader` can check a read now (`check`) and copy it later (`read_into`): the class that
    defines its `read` defines both (a subclass with its own `read`, or a wrapper answering `read` only
    and forwarding other attributes to its first reader, must be asked to `read`)."""
    owner = next((c for c in type(reader).__mro__ if "read" in vars(c)), None)
    return owner is not None and "read_into" in vars(owner) and "check" in vars(owner)


class CheckpointReader:
    """One tag of a checkpoint directory; see [Note: resume anywhere]."""

    # defaults for readers built without this __init__ (moe_io, autoep_zero3_io)
    mappings: Any = ()
    _zero3 = False
    _description: Description | None = None   # what partitioned files hold; None: whole values (replicated)
    model_name: str | None = None   # the model-states file read (ZeRO-3: this rank's)

    def __init__(self, load_dir: str, tag: str, mp_rank: int = 0, module_state: dict | None = None,
                 own_rank: int | None = None, loaded: tuple[str, dict] | None = None) -> None:
        """`own_rank`: the loading rank's data-parallel rank (its ZeRO-3 model-states file is read, and its
        optimizer-state file when metadata is needed before any slice: [Note: reading only what a rank
        needs]). `loaded`: (file name, content) of a model-states file the caller has loaded already; used
        when it is the one this reader reads."""
        wait_for_background_saves()
        path = tag_dir(load_dir, tag)
        if path is None:
            raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (no directory {tag})")
        self.path, self.tag, self.mp_rank = path, tag, mp_rank   # mp_rank: a pipeline stage's files
        self.mappings: list[Mapping] = []   # the files this reader loaded ([Note: released reads])
        self.rank_files = self._optim_files()
        self.universal = os.path.isdir(os.path.join(path, "zero")) and not self.rank_files
        own = own_rank or 0
        candidates = [model_file(mp_rank), model_file(mp_rank, zero3_dp_rank=own), model_file(mp_rank, zero3_dp_rank=0)]
        found = next((n for n in candidates if os.path.isfile(os.path.join(path, n))), None)
        if found is None:
            raise CheckpointError(f"{path}: no {model_file()} (nor {model_file(zero3_dp_rank=0)}); not a "
                                  "DeepSpeed checkpoint tag directory")
        self.model_name = found
        if loaded is not None and loaded[0] == found:
            self.model_states = dict(loaded[1])
            mapping = mapping_of(os.path.join(path, found), loaded[1])
            self.mappings += [mapping] if mapping is not None else []
        else:
            self.model_states = self._load(os.path.join(path, found))
        if module_state is not None:   # pipelines keep the module in per-layer files (runtime/pipe/checkpoint.py)
            self.model_states["module"] = module_state
        self.zero_states = RankFiles(self)
        self.optimizer_state = OptimizerStates(self.zero_states)
        self._own = own if own < len(self.rank_files) else 0
        # a ZeRO-3 tag has one model-states file per rank and no mp_rank_XX file (checked when a file opens)
        self._zero3 = bool(self.rank_files) and found != model_file(mp_rank)
        self._stage_value: int | None = None if self.rank_files else 0
        self._common: dict | None = None if self.rank_files else {}
        self._param_groups: list[dict] | None = None
        self._full: dict[str, dict[str, torch.Tensor]] = {}   # replicated layouts: field -> name -> tensor
        self._groups: list[list[tuple[str, torch.Size]]] = []
        self._where: dict[str, tuple[int, int]] = {}           # name -> (group, index)
        self._parts: dict[str, list[list[Any]]] = {}  # field -> group -> rank -> flat (None: not read yet)
        self._read_ranks: set[int] = set()
        if self.universal:
            self._init_universal()
        elif self.rank_files:
            self._init_partitioned()
        else:
            self._init_replicated()

    def _load(self, path: str) -> Any:
        """A file of this tag, memory-mapped; its mapping recorded so copies out of it give its pages back."""
        obj = load_file(path)
        mapping = mapping_of(path, obj)
        if mapping is not None:
            self.mappings = [*self.mappings, mapping]
        return obj

    @property
    def _meta(self) -> dict:
        """What every rank's optimizer-state file holds alike (stage, rank count, param groups, step, loss
        scaler): from the first file this reader opened, else its own rank's."""
        return self.optimizer_state[self.zero_states.first if self.zero_states.first is not None else self._own]

    def _opened(self, rank: int, state: dict) -> None:
        """A rank's file was just opened: what it records of its fragments is checked against the
        description the reads are planned from; the first one's rank count and stage are checked."""
        record = (state.get("optimizer_state_dict") or {}).get(FRAGMENTS_KEY)
        if record is not None and self._description is not None:
            self._description.check_record(record, rank, self.rank_files[rank])
        if self.zero_states.first is not None:
            return
        self._check_rank_count(state)
        stage = state.get("optimizer_state_dict", {}).get("zero_stage")
        if (stage is not None and int(stage) == 3) != self._zero3:
            raise CheckpointError(f"{self.rank_files[rank]}: written at ZeRO stage {stage}, but the tag's model-states "
                                  f"file is {self.model_name}: optimizer-state files of another checkpoint?")

    @property
    def stage(self) -> int:
        if self._stage_value is None:
            stage = self._meta.get("zero_stage")
            self._stage_value = 0 if stage is None else int(stage)  # stage-0 bf16 partitions like ZeRO-1, no zero_stage
        return self._stage_value

    @stage.setter
    def stage(self, value: int) -> None:
        self._stage_value = value

    @property
    def common_state(self) -> dict:
        """Optimizer-wide state (loss scaler, clip_grad, ...): any rank's file's (they are equal), or the
        universal checkpoint's common file."""
        return self._meta if self._common is None else self._common

    @common_state.setter
    def common_state(self, value: dict) -> None:
        self._common = value

    @property
    def param_groups(self) -> list[dict]:
        if self._param_groups is None:
            self._param_groups = self._base_param_groups()
        return self._param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._param_groups = value

    def opened_ranks(self) -> list[int]:
        """The saved ranks whose optimizer-state files this reader has opened so far."""
        return self.zero_states.opened()

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
        if count is not None:
            self._check_count(int(count[0] if isinstance(count, (list, tuple)) else count), "")

    def _check_count(self, expected: int, source: str) -> None:
        """`expected` saved ranks (a file's `partition_count`, or the `ds_layout` named by `source`)."""
        if expected != len(self.rank_files):
            prefix = os.path.basename(self.rank_files[0]).split("zero_pp_rank_")[0]
            missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_{self.mp_rank:02d}_optim_states.pt"
                       for r in range(expected) if r >= len(self.rank_files)]
            raise CheckpointError(f"{self.path}: written by {expected} ranks{source} but {len(self.rank_files)} "
                                  f"optimizer-state files are present; missing ranks "
                                  f"{list(range(len(self.rank_files), expected))}: {missing}")

    @property
    def world_size(self) -> int:
        """The saved data-parallel size: the number of optimizer-state files (checked against the
        `partition_count` of the first one opened), else the model states' `dp_world_size`."""
        if self.rank_files:
            return len(self.rank_files)
        return int(self.model_states.get("dp_world_size", 1) or 1)

    def param_names(self) -> list[str]:
        return [n for g in self._groups for n, _ in g]

    def groups(self) -> list[list[tuple[str, torch.Size]]]:
        return self._groups

    def has(self, name: str) -> bool:
        return name in self._where

    def fields(self) -> list[str]:
        if self._description is not None:
            return sorted(f for f in self._field_tables() if f != "fp32")
        return sorted(f for f in self._full if f != "fp32")

    # --- layouts ----------------------------------------------------------------------------
    def _init_partitioned(self) -> None:
        shapes = self.model_states.get("param_shapes")
        if shapes is None:
            raise CheckpointError(f"{self.path}: {model_file()} has no 'param_shapes'; cannot map the flat "
                                  "optimizer partitions to parameter names")
        layout = self.model_states.get(LAYOUT_KEY)
        try:   # recorded by the files ([Note: a checkpoint describes itself]), else DeepSpeed's rule
            described = Description.derived(shapes, self.world_size, self._zero3) if layout is None \
                else Description.from_layout(layout, shapes)
        except CheckpointError as error:
            raise CheckpointError(f"{os.path.join(self.path, self.model_name)}: {error}") from None
        self._check_count(described.world_size, f" (the {LAYOUT_KEY} of {self.model_name})")
        if (described.kind == PARAMWISE) != self._zero3:
            raise CheckpointError(f"{os.path.join(self.path, self.model_name)}: its {LAYOUT_KEY} describes "
                                  f"{described.summary()}, but the tag's files are{'' if self._zero3 else ' not'} "
                                  "ZeRO-3's (one model-states file per rank)")
        self._description = described
        groups = [dict(g) for g in described.groups]
        self._set_groups([{n: s for g in groups for n, s in g.items()}] if self._zero3 else groups)
        # no optimizer-state file is opened here: each is opened when a slice of it is first asked for,
        # and what all hold alike comes from the first one opened ([Note: reading only what a rank needs])

    def _base_states(self, state: dict) -> list[dict]:
        """A rank's base-optimizer state entries (each {field: tensor, "step": ...}), in key order."""
        if self._zero3:
            return _entries(state["optimizer_state_dict"]["state"])
        base = state["base_optimizer_state"]
        return _entries(base["state"]) if isinstance(base, dict) else list(base)

    def _field_tables(self) -> dict[str, list[list[Any]]]:
        """`_parts` with a table per field, the fields named by the metadata file (opened if none is)."""
        if not self._parts:
            meta = self._meta
            states = self._base_states(meta)
            self._step = self._find_step(states, {} if self._zero3 else meta)
            for field in ["fp32", *self._tensor_fields(states)]:
                self._parts[field] = [[None] * self.world_size for _ in range(self._description.num_flats)]
        return self._parts

    def _read_rank(self, rank: int) -> None:
        """Open saved rank `rank`'s optimizer-state file and enter its flats in `_parts`."""
        if rank in self._read_ranks:
            return
        state = self.optimizer_state[rank]
        self._field_tables()
        if self._zero3:
            fp32 = [joined(state["fp32_flat_groups"])]
            per_field = self._concat_state(self._base_states(state))
        else:
            fp32 = list(state["single_partition_of_fp32_groups"])
            groups = self._base_states(state)
            per_field = {f: [gs[f].reshape(-1) for gs in groups] for f in self._tensor_fields(groups)}
        self._add_parts("fp32", rank, fp32)
        for field, parts in per_field.items():
            if field in self._parts:
                self._add_parts(field, rank, parts)
        self._read_ranks.add(rank)

    def _concat_state(self, groups: list[dict]) -> dict[str, list[torch.Tensor]]:
        return {f: [joined([g[f] for g in groups])] for f in self._tensor_fields(groups)}

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
        table = self._parts[field]
        for g, part in enumerate(parts):
            table[g][rank] = part.reshape(-1)

    def _set_groups(self, shapes: list[dict]) -> None:
        self._groups = [[(n, torch.Size(s)) for n, s in g.items()] for g in shapes]
        self._where = {n: (g, i) for g, group in enumerate(self._groups) for i, (n, _) in enumerate(group)}

    def _base_param_groups(self) -> list[dict]:
        if not self.rank_files:
            return []
        state = self._meta
        base = state.get("base_optimizer_state") if not self._zero3 else state.get("optimizer_state_dict")
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
        if self.rank_files or self.universal:
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
                value = self._load(os.path.join(folder, entry))
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
        listed = {n: torch.Size(s) for g in (self.model_states.get("param_shapes") or []) for n, s in g.items()}
        trained = set(listed) or {n for f, values in full.items() if f != "fp32" for n in values}
        # DeepSpeed's converter writes a ZeRO-3 tag's dense parameters flat: their shape is param_shapes'
        shapes = {n: listed[n] if n in listed and listed[n].numel() == s.numel() else s
                  for n, s in shapes.items() if n in trained}
        for values in full.values():
            for name, value in values.items():
                if name in shapes and value.shape != shapes[name]:
                    values[name] = value.view(shapes[name])
        self._set_groups([shapes])
        self.param_groups = []
        optimizer_state = os.path.join(self.path, "zero", "optimizer_state.pt")
        if os.path.isfile(optimizer_state):
            self.common_state = load_file(optimizer_state)
            self.param_groups = [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.common_state.get("param_groups", [])]
            if self._step is None:   # DeepSpeed's ZeRO-3 form: no step.pt; its rank 0's optimizer state has it
                saved = (self.common_state.get("optimizer_state_dict") or {}).get("state") or {}
                self._step = next((float(e["step"]) for e in saved.values() if "step" in e), None)

    # --- reading ----------------------------------------------------------------------------
    @property
    def step(self) -> Any:
        if self._description is not None:
            self._field_tables()
        return self._step

    def has_field(self, name: str, field: str) -> bool:
        """Whether `read(name, field)` gives values (rather than None), without reading them."""
        if self._description is not None:
            return field in self._field_tables() and name in self._where
        return self._full.get(field, {}).get(name) is not None

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        """Elements [start, start+numel) of parameter `name`'s flattened `field`, as fp32 (a new tensor);
        None when the checkpoint has no such field for it."""
        g, i, numel = self._locate(name, start, numel)
        if not self.has_field(name, field):
            return None
        out = torch.empty(numel, dtype=torch.float32)  # host: read from files, copied by the caller
        self.read_into(out, name, field, start)
        return out

    def read_into(self, out: torch.Tensor, name: str, field: str, start: int = 0) -> None:
        """`read` straight into `out` (1-D, `out.numel()` elements, any dtype and device): no copy of its
        own in between, and the files' pages given back as they are read ([Note: released reads])."""
        g, i, numel = self._locate(name, start, out.numel())
        if self._description is None:
            value = self._full.get(field, {}).get(name)
            if value is None:
                raise CheckpointError(f"{self.path}: no {field!r} for parameter {name!r} in the checkpoint")
            copy_released(out, value.reshape(-1)[start:start + numel], self.mappings)
            return
        for read, part in self._pieces(name, field, start, numel):
            src, length, dst = read.flat_offset, read.numel, read.out_offset
            copy_released(out[dst:dst + length], part[src:src + length], self.mappings)

    def check(self, name: str, field: str, start: int = 0, numel: int | None = None) -> None:
        """Everything `read` would check (the files exist, load and hold the elements), without copying
        them: the read phase of a load whose copies run later ([Note: reading only what a rank needs])."""
        g, i, numel = self._locate(name, start, numel)
        if self._description is None:
            if self._full.get(field, {}).get(name) is None:
                raise CheckpointError(f"{self.path}: no {field!r} for parameter {name!r} in the checkpoint")
            return
        for _ in self._pieces(name, field, start, numel):
            pass

    def sources(self, name: str, start: int = 0, numel: int | None = None) -> list[Read]:
        """The pure plan of a read: the Description's reads (saved rank, flat, offset in it, length, offset
        in the result) for elements [start, start+numel) of `name` (partitioned layouts; [] otherwise)."""
        g, i, numel = self._locate(name, start, numel)
        return self._description.plan(name, start, numel) if self._description is not None else []

    def _locate(self, name: str, start: int, numel: int | None) -> tuple[int, int, int]:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no parameter named {name!r} in the checkpoint")
        g, i = self._where[name]
        total = self._groups[g][i][1].numel()
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(f"{self.path}: elements [{start}, {start + numel}) of {name!r} asked for; it has "
                                  f"{total}")
        return g, i, numel

    def _pieces(self, name: str, field: str, start: int, numel: int) -> Any:
        """(read, that rank's flat) per read of the plan, opening only those ranks' files: the executor."""
        for read in self._description.plan(name, start, numel):
            self._read_rank(read.rank)
            part = self._parts[field][read.flat][read.rank] if field in self._parts else None
            if part is None or part.numel() < read.flat_offset + read.numel:
                have = 0 if part is None else max(0, part.numel() - read.flat_offset)
                raise CheckpointError(f"{self.path}: parameter {name!r} ({field}) is incomplete in the checkpoint: "
                                      f"rank {read.rank}'s file holds {have} of the {read.numel} elements it should")
            yield read, part

    def module_tensor(self, name: str) -> torch.Tensor | None:
        """A module state-dict entry (buffer or frozen parameter), full size, or None."""
        value = (self.model_states.get("module") or {}).get(name)
        if value is not None and value.numel() > 0:
            return value
        if self._zero3 or getattr(self, "_stage_value", None) == 3:   # (readers that set their stage)
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
        others = self.__dict__.setdefault("_frozen_files", {})   # other ranks' model-states files, kept
        for rank in range(len(self.rank_files)):
            file = model_file(self.mp_rank, zero3_dp_rank=rank)
            states = self.model_states if file == (self.model_name or model_file(self.mp_rank, zero3_dp_rank=0)) \
                else others.get(file)
            if states is None:
                states = others[file] = self._load(os.path.join(self.path, file))
            pieces.append(states["frozen_param_fragments"][name].reshape(-1))
        numel = torch.Size(shape).numel()
        return torch.cat(pieces)[:numel].view(shape)  # slices of ceil(numel/N), the last zero-padded
