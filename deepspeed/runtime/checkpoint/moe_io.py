"""Checkpoints of engines with expert parallelism, in DeepSpeed's MoE layout.

[Note: MoE checkpoint layout]
As upstream: `mp_rank_00_model_states.pt` (rank 0) holds the engine's state and the module without
the experts; `layer_{L}_expert_{E}_mp_rank_00_model_states.pt` holds expert E of the L-th MoE layer
(registration order) under its GLOBAL name, `...deepspeed_experts.{E}...` with E = ep_rank *
num_local_experts + local id, written by the first rank of each expert-data-parallel group. The
optimizer goes to `expp_rank_{ep}_mp_rank_00_optim_states.pt` without ZeRO (the first EDP rank of
each EP rank; upstream's `{'optimizer': state_dict}` plus ours) and to every rank's
`[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt` with ZeRO. Ours in both is `ds_moe_pieces`:
each slice of a trained parameter the rank holds (HpState pieces), under global names, with its fp32
master and optimizer state. A slice names what it is, so loading works at any world size, ZeRO stage
and ep_size: MoECheckpointReader indexes the pieces of the memory-mapped files by local name and
offset, and each slice the usual loader asks for is copied out of the pieces holding it only then
(with NVMe offload, one sub-group at a time: the rank's state is never joined in memory).
zero_to_fp32 joins the same pieces into one fp32 state dict.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from ...checkpoint.files import CheckpointError, expert_file, expp_file
from ...checkpoint.mapped import copy_released
from ...checkpoint.reader import CheckpointReader
from ...moe.utils import is_moe_param
from ...utils import groups
from ...module_inject.auto_ep_layer import local_expert_state
from ..engine_moe import moe_layers
from ...checkpoint.constants import AUTOEP_LAYERS_KEY
from . import autoep_ds_zero12, moe_ds_ep
from .autoep_io import autoep_params, expert_entries, layer_metadata, module_rows, piece_in_whole
from .view import CheckpointView

EXPERT_RE = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")
PIECES = "ds_moe_pieces"



def is_moe_engine(view: CheckpointView) -> bool:
    """Expert parameters at ZeRO 0-2, or at ZeRO-3 with expert units on their expert-data-parallel
    groups (ep_size > 1; at ep_size=1 experts are ordinary parameters, named alike on every rank, and
    the usual ZeRO-3 layout holds them)."""
    stage3 = view.stage3
    return bool(view.expert_comm) and (stage3 is None or bool(stage3._param_groups))


def is_moe_checkpoint(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "layer_*_expert_*_model_states.pt")))


def reads_moe(view: CheckpointView, load_dir: str, tag: str) -> bool:
    """Whether the engine of `view` reads `load_dir/tag` with MoECheckpointReader: an MoE engine, or one with
    experts at ZeRO-3 and ep_size=1 (the usual ZeRO-3 layout when it saves) loading an MoE checkpoint."""
    from ...checkpoint.files import tag_dir

    if is_moe_engine(view):
        return True
    path = tag_dir(load_dir, tag) if view.expert_comm else None
    return path is not None and is_moe_checkpoint(path)


def global_names(view: CheckpointView) -> dict[str, tuple[int, int, str]]:
    """{local state-dict name of an expert tensor: (MoE layer id, global expert id, global name)}."""
    out = {}
    for layer_id, (prefix, layer) in enumerate(moe_layers(view.module)):
        ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
        local = int(layer.num_local_experts)
        for name in layer.state_dict(keep_vars=True).keys():
            match = EXPERT_RE.match(f"{prefix}.{name}" if prefix else name)
            if match:
                expert = ep_rank * local + int(match.group(2))
                out[match.group(0)] = (layer_id, expert, f"{match.group(1)}{expert}{match.group(3)}")
    autoep = autoep_params(view)   # AutoEP's fused experts: autoep_io.py
    missing = [n for n, p in view.module.named_parameters() if is_moe_param(p) and n not in out and n not in autoep]
    if missing:
        from ..errors import NotSupportedYet

        raise NotSupportedYet(f"save_checkpoint: expert parameters {missing} are not under an MoE layer's "
                              "`deepspeed_moe.experts.deepspeed_experts.<id>` (upstream's naming, which the MoE "
                              "checkpoint layout needs)")
    return out


def pieces_state(view: CheckpointView, hp: Any, renamed: dict[str, tuple[int, int, str]] | None = None,
                 stream: bool = False) -> dict:
    """This rank's optimizer file content: its pieces under global names (no collective). With
    `stream` and NVMe-offloaded state each value is a StreamedTensor read from the swap files when
    the file is written ([Note: streamed checkpoint file]); `hp.streamed` says which it got."""
    renamed = global_names(view) if renamed is None else renamed
    fields, step = hp.local_fields()
    autoep = autoep_params(view)
    local = {n: tuple(s) for g in hp.groups for n, s in g}   # this rank's shapes (ZeRO-3: not the placeholders')
    hp.streamed = stream and hp.swapper is not None
    pieces = []
    for piece in hp.pieces:
        if hp.streamed:
            values = {f: v for f in ("fp32", *fields) for v in [hp.streamed_piece(piece, f)] if v is not None}
        else:
            values = {"fp32": hp.value(piece, "fp32").detach().float().cpu().clone()}
            for field in fields:
                value = hp.state_value(piece, field)
                if value is not None:
                    values[field] = value.detach().float().cpu().clone()
        start = piece_in_whole(autoep, piece.name, local[piece.name], piece.start)[0] if piece.name in autoep \
            else piece.start
        pieces.append((renamed.get(piece.name, (0, 0, piece.name))[2], start, piece.numel, values))
    shapes = {renamed.get(n, (0, 0, n))[2]: piece_in_whole(autoep, n, s, 0)[1] if n in autoep else tuple(s)
              for n, s in local.items()}
    scaler = getattr(hp.wrapper, "loss_scaler", None)
    return {PIECES: pieces, "shapes": shapes, "step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in hp.base.param_groups],
            "loss_scaler": scaler.state_dict() if scaler is not None and hasattr(scaler, "state_dict") else None}


def gather_for_save(view: CheckpointView) -> dict[str, torch.Tensor] | None:
    """ZeRO-3 (collective, every rank alike): the whole values, by state-dict name, of what this rank's
    files hold (rank 0: the dense parameters; the first rank of each expert-data-parallel group: its
    EP rank's experts); None below ZeRO-3, where the parameters are whole."""
    from ... import comm as ds_comm
    from .zero3_io import gathered_params

    if view.stage3 is None:
        return None
    rank0 = ds_comm.get_rank() == 0

    def keep(p: torch.Tensor) -> bool:
        if not is_moe_param(p):
            return rank0
        return groups._get_expert_data_parallel_rank(str(p.group_name)) == 0

    gathered = gathered_params(view, lambda p: True, keep=keep)
    with local_expert_state():
        named = view.module.state_dict(keep_vars=True)
    return {k: gathered[id(v)] for k, v in named.items() if id(v) in gathered}


def save_entries(view: CheckpointView, hp: Any, client_state: dict, exclude_frozen: bool, snapshot: bool,
                 gathered: dict[str, torch.Tensor] | None = None) -> list:
    """This rank's files of an MoE checkpoint ([Note: MoE checkpoint layout]), as (name, object);
    `gathered`: gather_for_save's values at ZeRO-3."""
    from ... import comm as ds_comm
    from ...checkpoint import files
    from ...version import __version__
    from .writer import model_states

    from . import ep_tp_io

    renamed = global_names(view)
    autoep = autoep_params(view)
    entries: list = []
    mp, dp, dp_size = view.mp_rank, view.dp_rank, view.dp_world_size   # [Note: EP x TP checkpoint layout]
    if (ds_comm.get_rank() if gathered is not None else dp) == 0:
        frozen = None if gathered is None else {   # ZeRO-3: whole frozen values, saved as at ZeRO 1-2
            n: gathered[n] for n, p in view.module.named_parameters() if not p.requires_grad and n in gathered}
        with local_expert_state():   # rank 0 only: AutoEP's state_dict must not gather here
            state = model_states(view, hp, client_state, exclude_frozen, True, zero3_frozen=frozen,
                                 snapshot=snapshot)
        state["module"] = {k: (gathered or {}).get(k, v) for k, v in state["module"].items()
                           if k not in renamed and k not in autoep}
        if state.get("param_shapes"):
            state["param_shapes"] = [type(g)((n, s) for n, s in g.items() if n not in renamed and n not in autoep)
                                     for g in state["param_shapes"]]
        state["num_experts"] = list(view.num_experts)
        if autoep:
            state[AUTOEP_LAYERS_KEY] = layer_metadata(view)
        if ep_tp_io.tensor_size(view) > 1:
            ep_tp_io.model_record(view, state, dp, dp_size)
        entries.append((files.model_file(mp), state))
    with local_expert_state():
        module_state = view.module.state_dict() if gathered is None else gathered
    layers = [m for _, m in moe_layers(view.module)]
    by_expert: dict[tuple[int, int], dict] = {}
    for local, (layer_id, expert, name) in renamed.items():
        if groups._get_expert_data_parallel_rank(layers[layer_id].expert_group_name) == 0:
            by_expert.setdefault((layer_id, expert), ep_tp_io.expert_record(view, layers[layer_id]))[name] = \
                module_state[local].detach().cpu().clone()
    entries += [(expert_file(layer_id, expert, mp), sd) for (layer_id, expert), sd in sorted(by_expert.items())]
    entries += [(expert_file(*layer_expert, mp), {**ep_tp_io.expert_record(view, layers[layer_expert[0]]), **sd})
                for layer_expert, sd in expert_entries(view, autoep, gathered)]
    if hp is None:
        return entries
    pieces = pieces_state(view, hp, renamed, stream=hp.streamed)
    if view.zero_stage > 0:
        optim = {"optimizer_state_dict": pieces, "ds_config": view.ds_config, "ds_version": __version__,
                 **ep_tp_io.optimizer_record(view, dp, dp_size)}
        entries.append((files.optim_file(dp, bf16=view.bf16, mp_rank=mp),
                        files.Streamed(optim) if hp.streamed else optim))
    else:
        layer = view.moe_layers[0] if view.moe_layers else None
        name = layer.expert_group_name if layer is not None else f"ep_size_{groups._get_max_expert_size()}"
        if groups._get_expert_data_parallel_rank(name) == 0:
            entries.append((expp_file(groups._get_expert_parallel_rank(name), mp),
                            {"optimizer": hp.base.state_dict(), **pieces,
                             **(ep_tp_io.expert_record(view, layer) if layer is not None else {})}))
    return entries


def moe_reader(view: CheckpointView, load_dir: str, tag: str) -> Any:
    """The reader of a MoE-layout tag: MoECheckpointReader, or at another EP x TP layout than the one that
    saved it the tag joined whole (checkpoint/moe_to_universal.JoinedReader, a universal checkpoint's view,
    which the loader cuts as one: [Note: EP x TP checkpoint layout])."""
    from ...checkpoint.files import tag_dir
    from ...checkpoint.moe_to_universal import JoinedReader
    from . import ep_tp_io

    path = tag_dir(load_dir, tag)
    if path is not None and ep_tp_io.other_layout(view, path, view.mp_rank):
        return JoinedReader(path, tag)
    return MoECheckpointReader(view, load_dir, tag)


def _segments(pieces: list[tuple[int, int, torch.Tensor]], lo: int, hi: int) -> Any:
    """(value, offset in it, offset in [lo, hi), count) of the pieces (sorted by start) that hold
    elements of [lo, hi), each element taken once (stage-0 files repeat the dense parameters' pieces)."""
    at = lo
    for start, numel, value in pieces:
        if start >= hi:
            break
        a, b = max(at, start), min(hi, start + numel)
        if a < b:
            yield value, a - start, a - lo, b - a
            at = b


class MoECheckpointReader(CheckpointReader):
    """A MoE checkpoint as this rank's model sees it: values under its LOCAL names (its experts' global
    ids mapped back), so the usual loader reads the slices this rank owns, each when it asks for it."""

    def __init__(self, view: CheckpointView, load_dir: str, tag: str) -> None:
        from ...checkpoint.files import model_file, tag_dir
        from . import ep_tp_io

        path = tag_dir(load_dir, tag)
        if path is None:
            raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (no directory {tag})")
        mp, tp = view.mp_rank, ep_tp_io.tensor_size(view)   # [Note: EP x TP checkpoint layout]
        self.path, self.tag, self.mp_rank = path, tag, mp
        self.universal, self.stage, self.rank_files, self.zero_states = False, 0, [], []
        self.optimizer_state: list = []
        self.mappings = []   # the files loaded, so copies out of them give their pages back
        own = os.path.join(path, model_file(mp))
        source = own if os.path.isfile(own) else os.path.join(path, model_file(0))   # (its layout names the refusal)
        self.model_states = self._load(source)
        ep_tp_io.check_layout(view, path, self.model_states)
        if source != own:   # same layout but no file of this tensor rank: load_file names it
            self.model_states = self._load(own)
        self._fragment_cache, self._parts = {}, {}
        renamed = global_names(view)
        module = dict(self.model_states.get("module") or {})
        for local, (layer_id, expert, name) in renamed.items():
            source = ep_tp_io.expert_source(path, layer_id, expert, mp)
            if not os.path.isfile(source):
                raise CheckpointError(f"{path}: no {os.path.basename(source)} for {local} (global expert "
                                      f"{expert} of MoE layer {layer_id}): saved with fewer experts?")
            saved = self._load(source)
            if name not in saved:
                raise CheckpointError(f"{source} has no {name!r} (it holds {sorted(saved)})")
            module[local] = saved[name]
        autoep = autoep_params(view)
        # AutoEP's local expert rows stay in the mapped files: stacked only if asked for (frozen, module-only)
        self._rows = module_rows(path, autoep, mp)
        module.update({n: torch.empty((len(r),) + tuple(r[0].shape), dtype=r[0].dtype, device="meta")
                       for n, r in self._rows.items()})
        self.model_states["module"] = module
        wanted = {renamed.get(n, (0, 0, n))[2]: n for n in module}   # global name -> local name
        found = ep_tp_io.optimizer_files(sorted(glob.glob(os.path.join(path, "expp_rank_*_optim_states.pt")) +
                                                glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt"))), mp, tp)
        # field -> local name -> [(start in the saved whole, numel, the memory-mapped value)], read lazily
        self._lazy: dict[str, dict[str, list[tuple[int, int, torch.Tensor]]]] = {}
        self._offset: dict[str, int] = {}   # where this rank's values start in the saved whole (AutoEP rows)

        def needed(local: str) -> tuple[int, int]:
            """The flat range this rank reads: an AutoEP tensor's own experts' rows (under tensor parallelism
            the other rows are in other tensor ranks' files), else the whole."""
            numel = torch.Size(shapes[local]).numel()
            if local not in autoep:
                return 0, numel
            layer = autoep[local][1]
            per = numel // layer.num_experts
            return layer.first_expert * per, (layer.first_expert + layer.num_local_experts) * per
        shapes: dict[str, tuple] = {}
        self.param_groups, self._step, self.common_state = [], None, {}
        self._ds_optimizer = None
        states = [self._load(source) for source in found]
        if autoep_ds_zero12.is_deepspeed_zero12(self.model_states, states):   # upstream's flats, as pieces
            states = autoep_ds_zero12.pieces_of(path, found, states, self.model_states,
                                                len(getattr(view.optimizer, "param_groups", None) or []))
        if states and not any(PIECES in s.get("optimizer_state_dict", s) for s in states):
            self._ds_optimizer, self._ds_ep = _deepspeed_optimizer(view, path, found, states), _ep_layout(view)
            self._full = {"fp32": self._module_values(module)}
            return
        for source, state in zip(found, states):
            state = state.get("optimizer_state_dict", state)
            if PIECES not in state:
                raise CheckpointError(f"{source}: not written by this build's MoE checkpoint (no {PIECES})")
            self.param_groups = state["param_groups"]
            self._step = state["step"] if state["step"] is not None else self._step
            if state.get("loss_scaler") is not None:
                self.common_state = {"loss_scaler": state["loss_scaler"]}
            for name, start, numel, values in state[PIECES]:
                local = wanted.get(name)
                if local is None:
                    continue
                shapes[local] = tuple(state["shapes"][name])
                for field, value in values.items():
                    self._lazy.setdefault(field, {}).setdefault(local, []).append((start, numel, value.reshape(-1)))
        for pieces in self._lazy.values():
            for entries in pieces.values():
                entries.sort(key=lambda entry: entry[0])
        for local in shapes:
            lo, hi = needed(local)
            self._offset[local] = lo
            filled = sum(n for *_, n in _segments(self._lazy.get("fp32", {}).get(local, []), lo, hi))
            if filled < hi - lo:
                raise CheckpointError(f"{path}: parameter {local!r} is incomplete in the checkpoint's optimizer "
                                      f"files ({filled} of the {hi - lo} elements this rank reads)")
        self._full = {"fp32": {}}
        shapes = {n: tuple(module[n].shape) if n in autoep else s for n, s in shapes.items()}
        self._set_groups([shapes] if shapes else [{}])
        if not found:   # module weights only: every parameter from the module state
            self._full["fp32"] = self._module_values(module)
            self._set_groups([{n: t.shape for n, t in module.items() if n in dict(view.module.named_parameters())}])

    def _module_values(self, module: dict) -> dict[str, torch.Tensor]:
        return {n: self.module_tensor(n) if n in self._rows else t for n, t in module.items()}

    def module_tensor(self, name: str) -> torch.Tensor | None:
        if name in self._rows:
            return torch.stack(self._rows[name])
        return super().module_tensor(name)

    def fields(self) -> list[str]:
        return sorted((set(self._lazy) | set(self._full)) - {"fp32"})

    def has_field(self, name: str, field: str) -> bool:
        return name in self._lazy.get(field, {}) or super().has_field(name, field)

    def _runs(self, name: str, field: str, start: int, numel: int) -> list:
        """_segments of the pieces holding elements [start, start+numel) of `name`'s `field`; missing
        elements of the master raise (of optimizer state they read as zeros: a piece saved before its
        state existed)."""
        lo = self._offset[name] + start
        runs = list(_segments(self._lazy[field][name], lo, lo + numel))
        filled = sum(run[-1] for run in runs)
        if field == "fp32" and filled != numel:
            raise CheckpointError(f"{self.path}: parameter {name!r} ({field}) is incomplete in the checkpoint: "
                                  f"found {filled} of {numel} elements")
        return runs

    def check(self, name: str, field: str, start: int = 0, numel: int | None = None) -> None:
        if name not in self._lazy.get(field, {}):
            return super().check(name, field, start, numel)
        self._runs(name, field, start, self._locate(name, start, numel)[2])

    def read_into(self, out: torch.Tensor, name: str, field: str, start: int = 0) -> None:
        """A piece-backed value is copied out of the memory-mapped pieces that hold the range only now
        (never joined whole in memory: [Note: MoE checkpoint layout]), their pages given back as it goes
        ([Note: released reads])."""
        if name not in self._lazy.get(field, {}):
            return super().read_into(out, name, field, start)
        runs = self._runs(name, field, start, self._locate(name, start, out.numel())[2])
        if sum(run[-1] for run in runs) != out.numel():
            out.zero_()
        for value, at, to, count in runs:
            copy_released(out[to:to + count], value[at:at + count], self.mappings)

    def bind_replicated_names(self, optimizer_names: list, trainable: set, strict: bool = True) -> None:
        """Pieces are named; DeepSpeed's stage-0 `expp_rank_*` file keys its torch optimizer state by
        position in the optimizer's param groups, which this engine's groups name (they must list the
        same parameters: upstream's `split_params_into_different_moe_groups_for_optimizer` groups); saved at
        another ep_size, moe_ds_ep names each saved rank's positions from this model's groups."""
        saved = self._ds_optimizer
        if saved is None:
            return
        module, shapes = self.model_states["module"], {}
        if len(saved) != self._ds_ep[0]:   # [Note: DeepSpeed MoE optimizer at another ep_size]
            pairs, groups = moe_ds_ep.entries(self.path, saved, optimizer_names, module, *self._ds_ep[2:])
        else:
            sd = saved[self._ds_ep[1]]
            counts = [len(g["params"]) for g in sd["param_groups"]]
            if counts != [len(names) for names in optimizer_names]:
                raise CheckpointError(f"{self.path}: DeepSpeed's optimizer groups hold {counts} parameters, this "
                                      f"engine's {[len(n) for n in optimizer_names]}; build the optimizer groups as "
                                      "the saving job did (split_params_into_different_moe_groups_for_optimizer)")
            pairs = [(name, sd["state"].get(index, {})) for group, names in zip(sd["param_groups"], optimizer_names)
                     for index, name in zip(group["params"], names)]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        for name, entry in pairs:
            for field, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    self._full.setdefault(field, {})[name] = value
                elif field == "step":
                    self._step = float(value)
            if name in trainable:
                shapes[name] = module[name].shape
        self.param_groups = groups
        self._set_groups([shapes])


def _deepspeed_optimizer(view: CheckpointView, path: str, found: list[str], states: list[dict]) -> dict:
    """The torch optimizer states of DeepSpeed's own stage-0 MoE checkpoint by saved EP rank (`expp_rank_<ep>_...`:
    `{'optimizer': state_dict}`); its ZeRO-1/2 flats are read as pieces (autoep_ds_zero12) before this."""
    expp = {int(re.search(r"expp_rank_(\d+)_", os.path.basename(f)).group(1)): s
            for f, s in zip(found, states) if os.path.basename(f).startswith("expp_rank_")}
    if len(expp) != len(found) or any("optimizer" not in s for s in expp.values()):
        raise CheckpointError(f"{path}: optimizer files {[os.path.basename(f) for f in found]} are neither this "
                              "build's (ds_moe_pieces), DeepSpeed's stage-0 MoE files (expp_rank_*: 'optimizer') nor "
                              "its ZeRO-1/2 flats (single_partition_of_fp32_groups)")
    return {e: s["optimizer"] for e, s in expp.items()}


def _ep_layout(view: CheckpointView) -> tuple:
    """(ep_size, ep_rank, the expert renaming, experts per MoE layer, each layer's ep_size): what maps
    DeepSpeed's optimizer positions to this view's parameters at its ep_size or another."""
    name = view.moe_layers[0].expert_group_name if view.moe_layers else f"ep_size_{groups._get_max_expert_size()}"
    return (groups._get_expert_parallel_world_size(name), groups._get_expert_parallel_rank(name), global_names(view),
            [int(n) for n in view.num_experts], [int(m.ep_size) for m in view.moe_layers])


class GlobalNamedReader:
    """A universal checkpoint of a `deepspeed.moe` model as this rank sees it: each expert is a folder under
    its GLOBAL name (`...deepspeed_experts.{E}...`, as ds_to_universal writes it), read under this rank's
    local name; other EP ranks' experts are not this rank's parameters and are left out."""

    def __init__(self, reader: Any, renamed: dict[str, tuple[int, int, str]]) -> None:
        self.reader = reader
        self._global = {local: name for local, (_, _, name) in renamed.items()}
        self._local = {name: local for local, name in self._global.items()}

    def __getattr__(self, name: str) -> Any:   # path, model_states, common_state, step, fields, universal, ...
        return getattr(self.__dict__["reader"], name)

    def _mine(self, name: str) -> bool:
        return EXPERT_RE.match(name) is None or name in self._local

    def has(self, name: str) -> bool:
        return self.reader.has(self._global.get(name, name))

    def has_field(self, name: str, field: str) -> bool:
        return self.reader.has_field(self._global.get(name, name), field)

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        return self.reader.read(self._global.get(name, name), field, start, numel)

    def module_tensor(self, name: str) -> torch.Tensor | None:
        return self.reader.module_tensor(self._global.get(name, name))

    def param_names(self) -> list[str]:
        return [self._local.get(n, n) for n in self.reader.param_names() if self._mine(n)]

    def groups(self) -> list[list[tuple[str, torch.Size]]]:
        return [[(self._local.get(n, n), s) for n, s in g if self._mine(n)] for g in self.reader.groups()]

    def bind_replicated_names(self, *args: Any, **kwargs: Any) -> None:
        self.reader.bind_replicated_names(*args, **kwargs)


def universal_reader(view: CheckpointView, reader: Any) -> Any:
    """`reader` (a universal checkpoint) under this rank's local expert names (deepspeed.moe layers), its
    param groups as this view's optimizer has them (source_param_groups)."""
    renamed = global_names(view) if view.expert_comm else {}
    out = GlobalNamedReader(reader, renamed) if renamed else reader
    optimizer = view.optimizer
    count = len(getattr(optimizer, "param_groups", None) or [])
    saved = list(reader.param_groups or [])
    if count and saved and len(saved) != count:
        out.param_groups = source_param_groups(saved, count)
    return out


def source_param_groups(saved: list[dict], count: int) -> list[dict]:
    """The `count` groups an view that did not split its optimizer groups by expert group had, from groups
    written split as upstream's AutoEP view does (its dense groups first, then `moe` copies: the copies
    hold the same hyperparameters); other lists are returned as they are (the loader names the mismatch)."""
    dense = [g for g in saved if not g.get("moe")]
    return dense if len(dense) == count and len(dense) < len(saved) else saved
