"""engine.save_checkpoint / engine.load_checkpoint: DeepSpeed's semantics and layout, crash-safe.

Save: every rank must call it ([Note: arrival check] in comm/rendezvous.py turns a rank-0-only
call into an error instead of a hang); tags are validated across ranks; files go to a staging
directory that rank 0 publishes only after every rank succeeded ([Note: crash-safe save] in
checkpoint/files.py). Load: any layout, world size and stage ([Note: resume anywhere] in
checkpoint/reader.py); each rank reads only the slices it owns.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from ... import comm as ds_comm
from ...checkpoint import files
from ...checkpoint.reader import CheckpointReader
from ...utils.logging import log_dist, logger
from . import zero3_io
from .hp_state import HpState
from .writer import dp_rank, model_states, partitioned_optimizer_state, rng_state, set_rng_state

_ALL_RANKS = ("all ranks must call save_checkpoint/load_checkpoint (not only rank 0): every rank saves its "
              "own optimizer partition.")


def _partitioned(engine: Any) -> bool:
    """True when the optimizer state goes to per-rank files (ZeRO, or stage-0 mixed precision)."""
    return engine.optimizer is not None and (engine.zero_optimization_stage() > 0 or engine.precision.is_mixed)


def _validate_tag(engine: Any, tag: str) -> None:
    mode = engine._config.model.checkpoint.tag_validation
    if mode == "IGNORE" or ds_comm.get_world_size() == 1:
        return
    tags: list[Any] = [None] * ds_comm.get_world_size()
    ds_comm.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        message = f"checkpoint tag differs across ranks: {tags} (checkpoint.tag_validation={mode})"
        if mode == "FAIL":
            raise ValueError(message)
        logger.warning(message)


def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    if not save_dir:
        raise ValueError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name")
    ds_comm.arrive_and_wait("save_checkpoint", hint=_ALL_RANKS)
    _validate_tag(engine, tag)
    rank = engine.global_rank
    error = None
    if rank == 0:
        try:
            files.prepare_staging(save_dir, tag)
        except OSError as e:
            error = e
    _raise_if_any(error, f"save_checkpoint: cannot create {save_dir}/{tag}")
    staging = files.staging_dir(save_dir, tag)

    hp = HpState(engine) if engine.optimizer is not None else None
    partitioned = _partitioned(engine)
    optimizer_state, zero3 = None, engine._stage3 is not None
    # collectives, on every rank alike: re-cutting the partitions, gathering frozen ZeRO-3 pieces
    if partitioned:
        cut = zero3_io.optimizer_state if zero3 else partitioned_optimizer_state
        optimizer_state = cut(engine, hp, dp_rank(engine), engine.dp_world_size)
    frozen = zero3_io.frozen_fragments(engine, dp_rank(engine), engine.dp_world_size) \
        if zero3 and not exclude_frozen_parameters else None
    try:
        if rank == 0 or zero3:  # ZeRO-3: every rank writes its own model-states file
            state = model_states(engine, hp, dict(client_state or {}), exclude_frozen_parameters, partitioned,
                                 zero3_frozen=frozen if zero3 else None)
            name = files.model_file(zero3_dp_rank=dp_rank(engine)) if zero3 else files.model_file()
            files.save_file(state, os.path.join(staging, name))
        if optimizer_state is not None:
            name = files.optim_file(dp_rank(engine), bf16=engine.bfloat16_enabled())
            files.save_file({"optimizer_state_dict": optimizer_state, "ds_config": engine.config,
                             "ds_version": state_version()}, os.path.join(staging, name))
        files.save_file(rng_state(), os.path.join(staging, f"rng_state_{rank}.pt"))
    except Exception as e:  # reported on every rank below, so none waits for a failed peer
        error = e
    _raise_if_any(error, f"save_checkpoint: writing {save_dir}/{tag} failed",
                  cleanup=lambda: files.discard_staging(save_dir, tag))
    if rank == 0:
        try:
            files.commit_staging(save_dir, tag)
            if save_latest:
                files.write_text(os.path.join(save_dir, files.LATEST), tag)
            _copy_recovery_script(save_dir)
        except OSError as e:
            error = e
    _raise_if_any(error, f"save_checkpoint: publishing {save_dir}/{tag} failed")
    log_dist(f"Saved checkpoint {os.path.join(save_dir, tag)}", ranks=[0])
    return True


def optimizer_partition_state(engine: Any) -> dict:
    """This rank's `optimizer_state_dict` as save_checkpoint writes it (ZeRO; collective)."""
    cut = zero3_io.optimizer_state if engine._stage3 is not None else partitioned_optimizer_state
    return cut(engine, HpState(engine), dp_rank(engine), engine.dp_world_size)


def state_version() -> str:
    from ...version import __version__

    return __version__


def _raise_if_any(error: BaseException | None, what: str, cleanup: Any = None) -> None:
    """Raise on every rank if any rank failed (one small all-reduce), so no rank is left waiting."""
    failed = torch.tensor([1.0 if error is not None else 0.0])
    if ds_comm.get_world_size() > 1:
        ds_comm.all_reduce(failed, op=ds_comm.ReduceOp.MAX)
    if failed.item() > 0:
        if cleanup is not None and ds_comm.get_rank() == 0:
            cleanup()
        errors: list[Any] = [repr(error) if error is not None else None]
        if ds_comm.get_world_size() > 1:  # name every failing rank's error on every rank
            errors = [None] * ds_comm.get_world_size()
            ds_comm.all_gather_object(errors, repr(error) if error is not None else None)
        causes = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        raise RuntimeError(f"{what}: {causes}")


def _copy_recovery_script(save_dir: str) -> None:
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "utils", "zero_to_fp32.py")
    if os.path.isfile(source):
        target = os.path.join(save_dir, "zero_to_fp32.py")
        shutil.copyfile(source, target + ".tmp")
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)


# --- load -------------------------------------------------------------------------------------
def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
    ds_comm.arrive_and_wait("load_checkpoint", hint=_ALL_RANKS)
    if tag is None:
        latest = "latest_universal" if engine._config.model.checkpoint.load_universal else files.LATEST
        tag = files.read_latest(load_dir, latest)
        if tag is None:
            logger.warning(f"Unable to find latest file at {os.path.join(load_dir, latest)}; if trying to "
                           "load the latest checkpoint please pass an explicit tag or save one first.")
            return None, None
    tag = str(tag)
    reader = CheckpointReader(load_dir, tag)
    hp = HpState(engine) if engine.optimizer is not None else None
    if hp is not None:
        trainable = {n for g in hp.groups for n, _ in g}
        reader.bind_replicated_names(hp.optimizer_names, trainable)
    _load_module(engine, reader, hp, load_module_strict)
    state = reader.model_states
    if hp is not None:
        _load_masters(hp, reader)
        if load_optimizer_states and not load_module_only:
            _load_optimizer_state(hp, reader)
            _load_scaler(hp, reader)
        hp.refresh_model()
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        engine.global_steps = int(state.get("global_steps", 0))
        engine.global_samples = int(state.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(state.get("skipped_steps", 0))
        rng = os.path.join(reader.path, f"rng_state_{engine.global_rank}.pt")
        if os.path.isfile(rng):
            set_rng_state(files.load_file(rng, mmap=False))
    client_state = {k: v for k, v in state.items() if k not in _DEEPSPEED_KEYS}
    # DeepSpeed returns the model-states file this engine's layout reads (one per rank at ZeRO-3)
    name = files.model_file(zero3_dp_rank=dp_rank(engine)) if engine._stage3 is not None else files.model_file()
    path = os.path.join(load_dir, tag, name)
    log_dist(f"Loaded checkpoint {reader.path} (saved by {reader.world_size} rank(s), stage {reader.stage})",
             ranks=[0])
    return path, client_state


_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                   "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                   "mp_world_size", "ds_config", "ds_version", "optimizer_param_names",
                   "checkpoint_parallel_dimensions"}


def _load_module(engine: Any, reader: CheckpointReader, hp: HpState | None, strict: bool) -> None:
    """Buffers and frozen parameters from the module state; trained parameters from fp32 masters.

    Names are checked first: a checkpoint of another model fails with the missing and the
    unexpected names rather than a shape error deep inside. At ZeRO-3 parameter values go into
    this rank's slices of the gather units (zero3_io.write_params), not the released placeholders."""
    module = engine.module
    expected = set(module.state_dict().keys())
    saved = set(reader.model_states.get("module", {}).keys()) | set(reader.param_names())
    saved |= set((reader.model_states.get("frozen_param_fragments") or {}).keys())
    shared = reader.model_states.get("shared_params") or {}
    saved |= set(shared)
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if strict and (missing or unexpected):
        raise files.CheckpointError(f"{reader.path} does not match this model (load_module_strict=True): "
                                    f"missing {missing}, unexpected {unexpected}")
    trained = set(reader.param_names())
    named = dict(module.named_parameters())
    zero3 = engine._stage3 is not None
    shapes = zero3_io.param_shapes(engine) if zero3 else {n: p.shape for n, p in named.items()}
    by_param = {id(p): n for n, p in named.items()}
    params: dict[str, torch.Tensor] = {}   # parameter values to write, by first name
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
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
                tensor.copy_(value)
        for name in trained & set(named):
            if hp is None or not named[name].requires_grad:
                params[name] = reader.read(name, "fp32").view(shapes[name])
        if zero3:
            zero3_io.write_params(engine, params)
        else:
            for name, value in params.items():
                named[name].copy_(value)


def _load_masters(hp: HpState, reader: CheckpointReader) -> None:
    missing = sorted({p.name for p in hp.pieces if not reader.has(p.name)})
    if missing:
        raise files.CheckpointError(f"{reader.path} holds no fp32 weights for trainable parameters {missing}")
    with torch.no_grad():
        for piece in hp.pieces:
            piece.master.copy_(reader.read(piece.name, "fp32", piece.start, piece.numel))


def _load_optimizer_state(hp: HpState, reader: CheckpointReader) -> None:
    """Rebuild the base optimizer's state for this rank's pieces, through its own load_state_dict
    (which casts state to each tensor's dtype and device as the optimizer expects)."""
    fields = reader.fields()
    keys = [k for g in hp.base.param_groups for k in g["params"]]
    index = {id(k): i for i, k in enumerate(keys)}
    by_key = {id(p.key): p for p in hp.pieces}
    state = {}
    step = reader.step
    for key in keys:
        piece = by_key.get(id(key))
        if piece is None:
            continue
        entry: dict[str, Any] = {}
        for field in fields:
            value = reader.read(piece.name, field, piece.start, piece.numel)
            if value is not None:
                entry[field] = value.view_as(key)
        if entry and step is not None:
            entry["step"] = torch.tensor(float(step))
        if entry:
            state[index[id(key)]] = entry
    groups = hp.base.state_dict()["param_groups"]
    saved_groups = reader.param_groups
    if saved_groups and len(saved_groups) != len(groups):
        raise files.CheckpointError(f"{reader.path}: {len(saved_groups)} optimizer param groups saved, this "
                                    f"optimizer has {len(groups)}")
    for group, saved in zip(groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k in group and k != "params"})
    hp.base.load_state_dict({"state": state, "param_groups": groups})


def _load_scaler(hp: HpState, reader: CheckpointReader) -> None:
    scaler = getattr(hp.wrapper, "loss_scaler", None)
    common = reader.common_state
    saved = common.get("loss_scaler") or (common if "cur_scale" in common else None)  # stage-0 fp16 keeps it flat
    if scaler is None or saved is None:
        return
    dynamic = reader.common_state.get("dynamic_loss_scale")
    if not isinstance(saved, dict):
        dynamic = type(saved).dynamic if dynamic is None else dynamic
        saved = dict(vars(saved))
    # a scale saved by another precision (bf16/fp32 save a fixed 1.0) does not carry over to fp16
    if dynamic is not None and bool(dynamic) == scaler.dynamic:
        scaler.load_state_dict({k: v for k, v in saved.items() if k in scaler._STATE_KEYS})
