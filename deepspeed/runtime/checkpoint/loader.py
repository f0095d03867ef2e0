"""load_checkpoint in three phases: read (local), apply (local), re-gather (collective).

`read_plan` opens the tag, checks names and shapes and reads every value this rank will write
(its slices of the fp32 masters and optimizer state, buffers, frozen parameters, counters, RNG)
into a `LoadPlan`, touching nothing in the engine; `apply_plan` copies the plan into the engine.
Each local phase runs under an agreement ([Note: agreed errors] in runtime/agreement.py), so a
missing or corrupt file that one rank sees raises on every rank, and a failed read leaves the
engine untouched. Only then do the collectives run (re-gathering parameters from the masters).

[Note: non-strict loads]
With `load_module_strict=False` (DeepSpeed's semantics: torch's `load_state_dict(strict=False)`),
names the model has and the checkpoint lacks keep their current values, names only the
checkpoint has are ignored, and both lists go to a warning. For a trained parameter the
checkpoint lacks, this rank's fp32 master slices and optimizer state are left as they are, so
the re-gather after the load puts back exactly the values it had (masters and module weights
stay consistent). A shape mismatch is an error in both modes, as in torch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ...checkpoint import files
from ...checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from ...checkpoint.mapped import copy_released
from ...checkpoint.reader import CheckpointReader, checks_then_copies, is_universal
from ...utils.progress import NoBar, min_bytes, progress
from . import autoep_io, autoep_zero3_io, moe_io, tp_reslice, zero3_io
from ..swap_tensor.optimizer_swapper import placeholder
from .hp_state import HpState
from .view import CheckpointView, Counters
from .writer import set_rng_state

DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                  "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                  "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                  "mp_world_size", "ds_config", "ds_version", "optimizer_param_names",
                  "checkpoint_parallel_dimensions", "tp_partition_dims",
                  "tp_sub_param_sizes", "tensor_model_parallel_dims", "ds_layout"}


@dataclass
class LoadPlan:
    reader: CheckpointReader
    hp: HpState | None
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (target, value)
    # NVMe offload: pieces whose master / state (piece, field name) are read from the files when
    # their shard is in memory ([Note: optimizer state swapping]), not all at once
    master_copies: list[Any] = field(default_factory=list)
    state_fills: list[tuple[Any, str]] = field(default_factory=list)
    zero3_params: dict[str, torch.Tensor] | None = None   # ZeRO-3: full values by name (zero3_io)
    optimizer_state: dict | None = None                    # for the base optimizer's load_state_dict
    scaler_state: dict | None = None
    lr_scheduler: Any = None
    counters: Counters | None = None   # written back through view.set_counters
    rng: dict | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def read_plan(view: CheckpointView, load_dir: str, tag: Any, strict: bool, load_optimizer_states: bool,
              load_lr_scheduler_states: bool, load_module_only: bool) -> LoadPlan | None:
    """Everything this rank will load, read and checked; None when there is no `latest` to follow."""
    if tag is None:
        latest = "latest_universal" if view.load_universal else files.LATEST
        tag = files.read_latest(load_dir, latest)
        if tag is None:
            return None
    path = files.tag_dir(load_dir, str(tag))
    universal = path is not None and is_universal(path)
    # the model-states file this rank reads anyway: unpickled once, for the layout check and the reader
    layout = tp_reslice.saved_layout(load_dir, str(tag), view.mp_rank, view.dp_rank)
    resliced = tensor_parallel_reader(view, load_dir, str(tag), layout)
    if resliced is not None:   # [Note: moving a checkpoint across TP sizes]
        reader = resliced
    elif not universal and path is not None and _autoep_zero3(path, layout):
        reader = autoep_zero3_io.AutoEPZero3Reader(view, load_dir, str(tag))   # [Note: AutoEP ZeRO-3 layout]
    elif not universal and moe_io.reads_moe(view, load_dir, str(tag)):   # [Note: MoE checkpoint layout]
        reader = moe_io.moe_reader(view, load_dir, str(tag))
    elif view.reader_factory is not None:
        reader = view.reader_factory(view, load_dir, str(tag))
    else:   # a universal checkpoint has no tensor ranks' files: one mp_rank_00 (per pipeline stage)
        loaded = (layout[2], layout[1]) if layout[1] is not None else None
        reader = CheckpointReader(load_dir, str(tag), mp_rank=0 if universal else view.mp_rank,
                                  own_rank=view.dp_rank, loaded=loaded)
    if reader.universal:   # whole values: this run's tensor slices and expert rows are cut from them
        reader = moe_io.universal_reader(view, tp_reslice.universal_cut_reader(view, reader))
    reader = autoep_io.without_router_aliases(view, reader)   # [Note: AutoEP router alias]
    hp = HpState(view) if view.has_optimizer else None
    if hp is not None:
        trainable = {n for g in hp.groups for n, _ in g}
        reader.bind_replicated_names(hp.optimizer_names, trainable, strict=strict)
    plan = LoadPlan(reader, hp)
    autoep_io.check_expert_counts(view, reader)
    _plan_module(view, plan, strict)
    state = reader.model_states
    if hp is not None:
        _plan_masters(plan, strict)
        if load_optimizer_states and not load_module_only:
            _plan_optimizer_state(plan)
            plan.scaler_state = _scaler_state(hp, reader)
    if not load_module_only:
        if load_lr_scheduler_states and view.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            plan.lr_scheduler = state["lr_scheduler"]
        steps = int(state.get("global_steps", 0))
        plan.counters = Counters(steps, int(state.get("global_samples", steps * view.train_batch_size)),
                                 int(state.get("skipped_steps", 0)))
        rng = os.path.join(reader.path, f"rng_state_{view.global_rank}.pt")
        if os.path.isfile(rng):
            plan.rng = files.load_file(rng, mmap=False)
    return plan


def _autoep_zero3(path: str, layout: tuple) -> bool:
    """Whether the tag is in the AutoEP ZeRO-3 layout: the marker every rank's ZeRO-3 model-states file
    carries, read from the one this rank has loaded already (else autoep_zero3_io looks at rank 0's)."""
    from ...utils.zero_to_fp32 import is_autoep_zero3_partitioned

    _, states, name = layout
    if states is not None and name is not None and name.startswith("zero_pp_rank_"):
        return is_autoep_zero3_partitioned(states)
    return autoep_zero3_io.is_partitioned_checkpoint(path)


def load_hp_state(view: CheckpointView, checkpoint_dir: str) -> None:
    """This rank's fp32 masters, optimizer state and loss scaler from the universal checkpoint in
    `checkpoint_dir` (`optimizer.load_hp_checkpoint_state_from_checkpoint_dir`, upstream's API); the
    module's weights, counters and scheduler are left as they are. Local: no collective."""
    path = os.path.normpath(checkpoint_dir)
    reader = CheckpointReader(os.path.dirname(path) or ".", os.path.basename(path), mp_rank=view.mp_rank)
    if not reader.universal:
        raise files.CheckpointError(f"{path} is not a universal checkpoint (no zero/<param>/fp32.pt files and "
                                    "zero/optimizer_state.pt); write one with ds_to_universal")
    hp = HpState(view)
    reader.bind_replicated_names(hp.optimizer_names, {n for g in hp.groups for n, _ in g}, strict=True)
    plan = LoadPlan(reader, hp)
    _plan_masters(plan, strict=True)
    _plan_optimizer_state(plan)
    plan.scaler_state = _scaler_state(hp, reader)
    apply_plan(view, plan)


def tensor_parallel_reader(view: CheckpointView, load_dir: str, tag: str, layout: tuple | None = None) -> Any:
    """None when the checkpoint's tensor-parallel size is this run's; else the reader that moves its
    slices to this run's layout ([Note: moving a checkpoint across TP sizes]). Layouts it cannot move
    (MoE, pipelines, universal checkpoints) are refused, both sizes named. (Runs inside the load's
    agreed phase: every rank raises.)"""
    from ...module_inject.layers import tensor_parallel_size

    path, states, _ = layout or tp_reslice.saved_layout(load_dir, tag)
    if states is None:
        return None   # the reader names what is missing
    if is_universal(path):
        return None   # universal: whole values, cut after the layout's reader is built (read_plan)
    if view.reader_factory is not None:   # a pipeline's reader moves its stages' tensor slices itself
        return None   # ([Note: pipeline x tensor checkpoints at another layout] in runtime/pipe/checkpoint.py)
    mpu = view.mpu   # ALST's sequence-parallel mpu (parallel_state_sp) has no tensor groups
    if mpu is not None and not hasattr(mpu, "initialize_sequence_parallel") and not moe_io.is_moe_engine(view):
        return _client_mpu_reader(view, load_dir, tag, path, states)
    # our AutoTP files record tp_partition_dims; DeepSpeed 0.19.8's only universal_checkpoint_info (patterns, maps)
    described = states.get("tp_partition_dims") or states.get(UNIVERSAL_CHECKPOINT_INFO)
    saved = int(states.get("mp_world_size", 1) or 1) if described else 1
    have = tensor_parallel_size(view.module)
    if saved == have or moe_io.is_moe_checkpoint(path):   # the MoE layout's readers move EP x TP (moe_reader)
        return None
    if moe_io.is_moe_engine(view):
        raise files.CheckpointError(
            f"{path} was saved at tensor-parallel size (autotp_size) {saved}, and this run has autotp_size {have}: "
            f"resuming at another tensor-parallel size is supported for AutoTP engines (also in pipeline stages "
            f"and under ALST) and Megatron-style layers, without MoE; resume with autotp_size={saved} (any "
            f"data-parallel size)")
    return tp_reslice.resliced_reader(view, load_dir, tag, saved, states, view.mp_rank)


def _client_mpu_reader(view: CheckpointView, load_dir: str, tag: str, path: str, states: dict) -> Any:
    """Your Megatron-style tensor layers on a client mpu: None at the saved tensor size, else the TP re-slicing
    reader over the saved tensor ranks' file sets (`mp_rank_{t}`), cut along the `partition_dim`s the files
    record (`tensor_model_parallel_dims`; at saved size 1, along this run's)."""
    from .writer import MEGATRON_TP_DIMS

    size, index, own_dims, own_blocks = tp_reslice.engine_tensor_layout(view)
    saved = int(states.get("mp_world_size", 1) or 1)
    if saved == size:
        return None
    dims, blocks = tp_reslice.recorded_dims(states, saved, own_dims, own_blocks)
    if saved > 1 and not dims:
        raise files.CheckpointError(
            f"{path} was saved at tensor-parallel size {saved} and this run's mpu has {size}, but the checkpoint "
            f"records no partition dims of its tensor layers ({MEGATRON_TP_DIMS}); resume at tensor size {saved}, "
            f"or convert it with ds_to_universal from a checkpoint that records them")
    readers = [CheckpointReader(load_dir, tag, mp_rank=t) for t in range(saved)]
    return tp_reslice.TPReslicedReader(readers, dims, blocks, size, index)


def apply_plan(view: CheckpointView, plan: LoadPlan) -> None:
    """Copy the plan into the engine (local; the caller re-gathers afterwards)."""
    total = sum(value.numel() * value.element_size() for _, value in plan.copies)
    bar = progress(total=total, desc="Loading checkpoint", unit="B", unit_scale=True) if total >= min_bytes() \
        else NoBar()
    with torch.no_grad(), bar:
        mappings = getattr(plan.reader, "mappings", ())
        for target, value in plan.copies:   # reads the memory-mapped checkpoint files, giving their pages back
            if isinstance(value, _Pending):
                value.copy_to(target)
            else:
                copy_released(target, value, mappings)
            bar.update(value.numel() * value.element_size())
        if plan.zero3_params is not None:
            swapper = getattr(plan.hp, "swapper", None)
            with swapper.all_resident(True) if swapper is not None and plan.zero3_params else contextlib.nullcontext():
                zero3_io.write_param_slices(view, plan.zero3_params)   # frozen pieces of units with masters
    if plan.optimizer_state is not None:
        plan.hp.base.load_state_dict(plan.optimizer_state)
    if plan.hp is not None and plan.hp.swapper is not None:
        _apply_swapped_masters(plan)
    if plan.scaler_state is not None:
        plan.hp.wrapper.loss_scaler.load_state_dict(plan.scaler_state)
    if plan.lr_scheduler is not None:
        view.lr_scheduler.load_state_dict(plan.lr_scheduler)
    if plan.counters is not None:
        view.set_counters(plan.counters)
    if plan.rng is not None:
        set_rng_state(plan.rng)


def _apply_swapped_masters(plan: LoadPlan) -> None:
    """NVMe offload ([Note: optimizer state swapping]): one shard in memory at a time, after
    `load_state_dict` (which got placeholders for the state): its masters and state read from the
    (memory-mapped) checkpoint files now, written back by the swapper, dropped. The rank's whole
    state is never in memory at once (docs/offload.md, measured)."""
    masters: dict[int, list[Any]] = {}
    fills: dict[int, list[tuple[Any, str]]] = {}
    for piece in plan.master_copies:
        masters.setdefault(piece.shard, []).append(piece)
    for piece, name in plan.state_fills:
        fills.setdefault(piece.shard, []).append((piece, name))
    reader, hp = plan.reader, plan.hp

    def apply(i: int) -> None:
        with torch.no_grad():
            for piece in masters.get(i, ()):
                hp.value(piece, "fp32").copy_(reader.read(piece.name, "fp32", piece.start, piece.numel))
            for piece, name in fills.get(i, ()):
                target = hp.base.state[piece.key][name]
                target.set_(reader.read(piece.name, name, piece.start, piece.numel).view(target.shape).to(target.dtype))
    hp.swapper.load_streamed(apply)


def _plan_module(view: CheckpointView, plan: LoadPlan, strict: bool) -> None:
    """Buffers and frozen parameters from the module state; trained parameters from fp32 masters.

    Names are checked first: a checkpoint of another model fails with the missing and the
    unexpected names rather than a shape error deep inside. At ZeRO-3 parameter values go into
    this rank's slices of the gather units (zero3_io), not the released placeholders."""
    from ...module_inject.auto_ep_layer import local_expert_state

    reader, hp = plan.reader, plan.hp
    module = view.module
    with local_expert_state():   # AutoEP experts as this rank's parameters: no gather of whole tensors
        named_state = autoep_io.drop_router_aliases(view, module.state_dict(keep_vars=True))
    expected = set(named_state.keys())
    saved = set((reader.model_states.get("module") or {}).keys()) | set(reader.param_names())
    saved |= set((reader.model_states.get("frozen_param_fragments") or {}).keys())
    shared = reader.model_states.get("shared_params") or {}
    saved |= set(shared)
    plan.missing, plan.unexpected = sorted(expected - saved), sorted(saved - expected)
    if strict and (plan.missing or plan.unexpected):
        raise files.CheckpointError(f"{reader.path} does not match this model (load_module_strict=True): "
                                    f"missing {plan.missing}, unexpected {plan.unexpected}")
    trained = set(reader.param_names())
    named = dict(module.named_parameters())
    zero3 = view.stage3 is not None
    shapes = zero3_io.param_shapes(view) if zero3 else {n: p.shape for n, p in named.items()}
    by_param = {id(p): n for n, p in named.items()}
    params: dict[str, torch.Tensor] = {}   # parameter values to write, by first name
    for name, tensor in named_state.items():
        if name in trained or name not in saved:
            continue
        value = reader.module_tensor(shared.get(name, name))
        if value is None:
            continue
        first = by_param.get(id(tensor))
        shape = shapes[first] if first is not None else tensor.shape
        if value.shape != shape:
            raise files.CheckpointError(f"{reader.path}: {name} has shape {tuple(value.shape)} in the "
                                        f"checkpoint, {tuple(shape)} in the model")
        if first is not None:
            params[first] = value
        else:
            plan.copies.append((tensor, value))
    for name in trained & set(named):
        if hp is None or not named[name].requires_grad:
            value = reader.read(name, "fp32")
            if value.numel() != shapes[name].numel():
                raise files.CheckpointError(f"{reader.path}: {name} has {value.numel()} elements in the "
                                            f"checkpoint, shape {tuple(shapes[name])} in the model")
            params[name] = value.view(shapes[name])
    if zero3:
        plan.zero3_params = params
    else:
        plan.copies += [(named[name].data, value) for name, value in params.items()]


def _plan_masters(plan: LoadPlan, strict: bool) -> None:
    reader, hp = plan.reader, plan.hp
    absent = sorted({p.name for p in hp.pieces if not reader.has(p.name)})
    if absent and strict:
        raise files.CheckpointError(f"{reader.path} holds no fp32 weights for trainable parameters {absent}")
    for name in absent:  # non-strict: these keep their masters (and module values)
        if name not in plan.missing:
            plan.missing.append(name)
    shapes = dict(n_s for g in reader.groups() for n_s in g)
    for g in hp.groups:
        for name, shape in g:
            if name in shapes and torch.Size(shapes[name]) != torch.Size(shape):
                raise files.CheckpointError(f"{reader.path}: {name} has shape {tuple(shapes[name])} in the "
                                            f"checkpoint, {tuple(shape)} in the model")
    direct = checks_then_copies(reader)
    for piece in hp.pieces:
        if reader.has(piece.name):
            if hp.swapper is not None:   # the master is on disk: read and written shard by shard in apply_plan
                plan.master_copies.append(piece)
            elif direct:   # checked now, copied file -> master in apply_plan (no copy in between)
                reader.check(piece.name, "fp32", piece.start, piece.numel)
                plan.copies.append((piece.master, _Pending(reader, piece.name, "fp32", piece.start, piece.numel)))
            else:
                plan.copies.append((piece.master, reader.read(piece.name, "fp32", piece.start, piece.numel)))


class _Pending:
    """A checked read whose copy into its target waits for apply_plan ([Note: released reads])."""

    def __init__(self, reader: Any, name: str, field: str, start: int, numel: int) -> None:
        self.reader, self.name, self.field, self.start, self._numel = reader, name, field, start, numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4

    def copy_to(self, target: torch.Tensor) -> None:
        if target.is_contiguous():
            self.reader.read_into(target.view(-1), self.name, self.field, self.start)
        else:
            target.copy_(self.reader.read(self.name, self.field, self.start, self._numel).view(target.shape))


_FP32 = torch.empty(0, dtype=torch.float32, device="cpu")   # host: what reader.read returns (dtype only)


def _state_dtype(base: Any, key: torch.Tensor, name: str, value: torch.Tensor) -> torch.dtype:
    """The dtype `base` keeps state `name` of `key` in: that of its current state, else the one its
    fresh state gets (DeepSpeed's Adam: `_state_dtype`, None meaning the master's, e.g. bf16 moments
    behind bf16 masters), else the file's (fp32; torch.optim casts to the master's dtype itself)."""
    current = base.state.get(key, {}).get(name)
    if torch.is_tensor(current) and current.is_floating_point():
        return current.dtype
    if hasattr(base, "_state_dtype") and value.is_floating_point():
        return base._state_dtype or key.dtype
    return value.dtype


def _plan_optimizer_state(plan: LoadPlan) -> None:
    """The base optimizer's state for this rank's pieces, loaded through its own load_state_dict
    (which casts state to each tensor's dtype and device as the optimizer expects). Pieces of
    parameters the checkpoint lacks keep the state they have ([Note: non-strict loads])."""
    reader, hp = plan.reader, plan.hp
    fields = reader.fields()
    keys = [k for g in hp.base.param_groups for k in g["params"]]
    index = {id(k): i for i, k in enumerate(keys)}
    # A checkpoint holds every field for every group; an optimizer whose groups keep different
    # state (MuonWithAuxAdam: momentum_buffer vs exp_avg/exp_avg_sq/step) takes only its own.
    wanted_of = getattr(hp.base, "state_fields", None)
    if reader.universal:
        _check_universal_fields(reader, hp, fields, wanted_of)
    wanted = {id(k): wanted_of(g) for g in hp.base.param_groups for k in g["params"]} if wanted_of else {}
    by_key = {id(p.key): p for p in hp.pieces}
    state = {}
    step = reader.step
    for key in keys:
        piece = by_key.get(id(key))
        if piece is None:
            continue
        if not reader.has(piece.name):
            if key in hp.base.state:
                state[index[id(key)]] = dict(hp.base.state[key])
            continue
        entry: dict[str, Any] = {}
        own = wanted.get(id(key))
        for name in fields:
            if own is not None and name not in own:
                continue
            if hp.swapper is not None:   # NVMe offload: a placeholder now, filled shard by shard in apply_plan
                if not reader.has_field(piece.name, name):
                    continue
                entry[name] = placeholder(key.shape, _state_dtype(hp.base, key, name, _FP32))
                plan.state_fills.append((piece, name))
                continue
            value = reader.read(piece.name, name, piece.start, piece.numel)
            if value is not None:
                entry[name] = value.view_as(key).to(_state_dtype(hp.base, key, name, value))
        if entry and step is not None and (own is None or "step" in own):
            entry["step"] = torch.tensor(float(step))  # host: torch.optim's step counter
        if entry:
            state[index[id(key)]] = entry
    # the raw param groups (torch's state_dict form; not the base optimizer's state_dict(), which at
    # ZeRO-1/2 shows per-group flats: [Note: the base optimizer's state_dict at ZeRO-1/2])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(k)] for k in g["params"]]}
              for g in hp.base.param_groups]
    saved_groups = reader.param_groups
    if saved_groups and len(saved_groups) != len(groups):
        raise files.CheckpointError(f"{reader.path}: {len(saved_groups)} optimizer param groups saved, this "
                                    f"optimizer has {len(groups)}")
    for group, saved in zip(groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k in group and k != "params"})
    plan.optimizer_state = {"state": state, "param_groups": groups}


def _check_universal_fields(reader: CheckpointReader, hp: HpState, fields: list[str], wanted_of: Any) -> None:
    """Every trained parameter of a universal checkpoint has each optimizer-state file the others have
    (of those its group keeps): one folder lacking e.g. exp_avg_sq.pt would otherwise load without it and
    fail at the next step (torch's Adam: KeyError). Checked over all parameters, so every rank raises the
    same error before any collective, whichever rank holds the parameter."""
    for g, group in enumerate(hp.groups):
        own = wanted_of(hp.base.param_groups[g]) if wanted_of is not None and g < len(hp.base.param_groups) \
            else None
        expected = [f for f in fields if own is None or f in own]
        for name, _ in group:
            lacking = [f for f in expected if reader.has(name) and not reader.has_field(name, f)]
            if lacking:
                folder = os.path.join(reader.path, "zero", name)
                raise files.CheckpointError(
                    f"{folder}: parameter {name!r} has no {', '.join(f + '.pt' for f in lacking)} in this universal "
                    f"checkpoint; every trained parameter's folder must hold fp32.pt and the optimizer state the "
                    f"others have ({', '.join(f + '.pt' for f in expected)}); reconvert with ds_to_universal, "
                    f"or load with load_optimizer_states=False")


def _scaler_state(hp: HpState, reader: CheckpointReader) -> dict | None:
    scaler = getattr(hp.wrapper, "loss_scaler", None)
    common = reader.common_state
    saved = common.get("loss_scaler") or (common if "cur_scale" in common else None)  # stage-0 fp16 keeps it flat
    if scaler is None or saved is None:
        return None
    dynamic = reader.common_state.get("dynamic_loss_scale")
    if not isinstance(saved, dict):
        dynamic = type(saved).dynamic if dynamic is None else dynamic
        saved = dict(vars(saved))
    # a scale saved by another precision (bf16/fp32 save a fixed 1.0) does not carry over to fp16
    if dynamic is not None and bool(dynamic) == scaler.dynamic:
        return {k: v for k, v in saved.items() if k in scaler._STATE_KEYS}
    return None
