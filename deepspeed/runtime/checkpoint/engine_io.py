"""engine.save_checkpoint / engine.load_checkpoint: DeepSpeed's semantics and layout, crash-safe.

Save: every rank must call it ([Note: arrival check] in comm/rendezvous.py turns a rank-0-only
call into an error instead of a hang); tags are validated across ranks; files go to a staging
directory that rank 0 publishes only after every rank succeeded ([Note: crash-safe save] in
checkpoint/files.py), in a background thread by default or inline ([Note: background save] in
save_job.py). Load: any layout, world size and stage ([Note: resume anywhere] in
checkpoint/reader.py); each rank reads only the slices it owns (loader.py). Every local phase
of both is agreed across ranks before the next collective ([Note: agreed errors]). The engine passes a
CheckpointView, not itself ([Note: checkpoint view] in view.py; the trip: docs/checkpointing.md).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable

from ... import comm as ds_comm
from ...checkpoint import files
from ...checkpoint.description import LAYOUT_KEY, Description
from ...checkpoint.stream_save import Streamed
from ...utils.logging import log_dist, logger
from ..errors import ArgumentError
from . import autoep_zero3_io, moe_io, zero3_io
from .agree import agreed, agreed_gather, describe, raise_if_any
from .hp_state import HpState, combine_fields
from .loader import DEEPSPEED_KEYS, apply_plan, read_plan
from .save_job import PeerFailed, PendingSave, SaveJob, wait_all_local
from .view import CheckpointView, PendingSlot
from .writer import model_states, partitioned_optimizer_state, rng_state

_ALL_RANKS = ("all ranks must call save_checkpoint/load_checkpoint (not only rank 0): every rank saves its "
              "own optimizer partition.")


def _state_resident(dirty: bool) -> Callable:
    """Run with NVMe-offloaded optimizer state read in ([Note: optimizer state swapping]; written
    back after if `dirty`), so checkpoints read and write it as with CPU offload. NVMe parameter
    shards stream: each is read in when the writer touches it ([Note: parameter swapping])."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(view: CheckpointView, *args: Any, **kwargs: Any) -> Any:
            from ..swap_tensor.optimizer_swapper import resident

            params = getattr(view.stage3, "swapper", None)
            if params is not None:   # offload_param nvme: a failed shard read/write raises on every rank first
                params.check(f"{fn.__name__} with offload_param.device nvme")
            with resident(view.optimizer, dirty):
                return fn(view, *args, **kwargs)
        return inner
    return wrap


def _partitioned(view: CheckpointView) -> bool:
    """True when the optimizer state goes to per-rank files (ZeRO, or stage-0 mixed precision)."""
    return view.has_optimizer and (view.zero_stage > 0 or view.mixed_precision)


def _validate_tag(view: CheckpointView, tags: list[str]) -> str:
    """The tag every rank saves under: rank 0's (`tags`: every rank's). Tags that differ across
    ranks raise with tag_validation FAIL (also an AssertionError, as upstream's assert); with WARN
    (warned) or IGNORE every rank uses rank 0's tag, so the ranks still write one complete, loadable
    checkpoint (upstream lets each rank write into its own tag's folder: no folder holds a whole
    checkpoint)."""
    if len(set(tags)) > 1:
        mode = view.tag_validation
        message = f"checkpoint tag differs across ranks: {tags} (checkpoint.tag_validation={mode})"
        if mode == "FAIL":
            raise ArgumentError(message)
        if mode == "WARN":
            logger.warning(f"{message}; every rank saves under rank 0's tag {tags[0]!r}")
    return tags[0]


@_state_resident(dirty=False)
def save_checkpoint(view: CheckpointView, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    ds_comm.arrive_and_wait("save_checkpoint", hint=_ALL_RANKS)
    wait_for_checkpoint(view.pending)  # a background save still running: finish it (and agree) first
    what = "save_checkpoint"
    rank = view.global_rank
    background = bool(view.async_save)

    partitioned = _partitioned(view)
    autoep3 = autoep_zero3_io.uses_layout(view)   # [Note: AutoEP ZeRO-3 layout]: upstream's files, no re-cut
    moe = moe_io.is_moe_engine(view) and not autoep3   # [Note: MoE checkpoint layout]: named pieces, no re-cut

    def begin() -> tuple[HpState | None, tuple]:
        """Local: check the tag, read the optimizer's layout, (rank 0) make the staging directory;
        shared with every rank in the same collective as the agreement: the tag and the fields."""
        checked = _checked_tag(view, save_dir, tag)
        hp = HpState(view) if view.has_optimizer else None
        if rank == 0:
            files.prepare_staging(save_dir, checked)
        return hp, (checked, hp.local_fields() if partitioned and hp.zero else None)

    hp, shared = agreed_gather(what, begin, cleanup=lambda: files.discard_staging(save_dir, _checked_tag(
        view, save_dir, tag)))
    try:
        tag = _validate_tag(view, [t for t, _ in shared])  # every rank sees the same tags and raises alike
    except ValueError:
        if rank == 0:
            files.discard_staging(save_dir, shared[0][0])
        raise
    fields_step = None
    if partitioned and hp.zero and not moe:  # the data-parallel group's optimizer fields, from what was gathered
        group = view.dp_group
        fields_step = combine_fields([shared[ds_comm.get_global_rank(group, r)][1]
                                      for r in range(ds_comm.get_world_size(group))])
    optimizer_state, zero3 = None, view.stage3 is not None
    later: list = []  # the re-cut's local finishing work: on the writer's thread (HpState.recut_fields)
    # collectives, on every rank alike: re-cutting the partitions, gathering frozen ZeRO-3 pieces
    if partitioned and not moe and not autoep3:
        cut = zero3_io.optimizer_state if zero3 else partitioned_optimizer_state
        optimizer_state = cut(view, hp, view.dp_rank, view.dp_world_size, later=later, fields_step=fields_step,
                              stream=True)
    if moe and hp is not None:   # its pieces stream in save_entries, with no re-cut ([Note: MoE checkpoint layout])
        hp.streamed = hp.swapper is not None
    streamed = hp is not None and hp.streamed   # [Note: streamed checkpoint file]: read from the swap files
    optim, optim_name = None, files.optim_file(view.dp_rank, bf16=view.bf16, mp_rank=view.mp_rank)
    if optimizer_state is not None:
        optim = {"optimizer_state_dict": optimizer_state, "ds_config": view.ds_config, "ds_version": state_version()}
        optim = Streamed(optim) if streamed else optim
        if hp.exchange is not None:   # [Note: streamed re-cut]: written now, while exchanging; raised when agreed
            optim = hp.exchange.write(optim, os.path.join(files.staging_dir(save_dir, tag), optim_name))
    frozen = zero3_io.frozen_fragments(view, view.dp_rank, view.dp_world_size) \
        if zero3 and not moe and not exclude_frozen_parameters else None
    gathered = moe_io.gather_for_save(view) if moe else None   # ZeRO-3: the whole values the files hold
    if streamed and background and hp.exchange is None:   # [Note: swap files under a background save]
        hp.view = hp.swapper.save_view()
        if hp.view is None:
            log_dist("save_checkpoint: NVMe-offloaded optimizer state is in memory now, so this save is written "
                     "before save_checkpoint returns (async_save does not apply)", ranks=[0])
            background = False
    release = [hp.view.close] if streamed and hp.view is not None else []

    def snapshot() -> SaveJob:
        """This rank's files as objects; with a background write, nothing in them aliases live state."""
        entries = []
        mp = view.mp_rank
        if moe:
            client = copy.deepcopy(client_state or {}) if background else dict(client_state or {})
            entries = moe_io.save_entries(view, hp, client, exclude_frozen_parameters, background, gathered)
        elif autoep3:
            client = copy.deepcopy(client_state or {}) if background else dict(client_state or {})
            entries = autoep_zero3_io.save_entries(view, hp, client, exclude_frozen_parameters, background, frozen,
                                                   fields_step)
        elif view.dp_rank == 0 or zero3:  # ZeRO-3: every rank writes its own model-states file
            client = copy.deepcopy(client_state or {}) if background else dict(client_state or {})
            state = model_states(view, hp, client, exclude_frozen_parameters, partitioned,
                                 zero3_frozen=frozen if zero3 else None, snapshot=background)
            if optimizer_state is not None:   # what the optimizer-state files hold, for a load's plan
                state[LAYOUT_KEY] = Description.of(hp.groups, view.dp_world_size, zero3).layout()
            entries.append((files.model_file(mp, zero3_dp_rank=view.dp_rank if zero3 else None), state))
            entries += view.extra_files(exclude_frozen_parameters) if view.extra_files is not None else []
        if optim is not None:
            entries.append((optim_name, optim))
        entries.append((f"rng_state_{rank}.pt", rng_state()))
        return SaveJob(save_dir, tag, rank, ds_comm.get_world_size(), entries, save_latest, prepare=later,
                       release=release)

    try:
        return _write_and_publish(view, hp, save_dir, tag, background, snapshot, what, rank)
    except BaseException:
        for done in release:   # not handed to a writer
            done()
        raise


def _write_and_publish(view: CheckpointView, hp: Any, save_dir: str, tag: str, background: bool,
                       snapshot: Callable, what: str, rank: int) -> bool:
    """save_checkpoint's last phases: this rank's files (agreed), then rank 0 publishes (agreed)."""
    def written(job: SaveJob) -> SaveJob:
        try:
            job.write(durable=False)  # [Note: durable later]
        except BaseException:
            job.close()
            raise
        return job

    discard = lambda: files.discard_staging(save_dir, tag)  # noqa: E731
    job, names = agreed_gather(f"{what}: snapshot of {save_dir}/{tag}",
                               lambda: (lambda j: (j, [n for n, _ in j.entries]))(snapshot()), cleanup=discard)
    _refuse_clashing_names(job, names, discard)
    if background:  # [Note: background save]
        view.pending.put(PendingSave(job))
        log_dist(f"Saving checkpoint {os.path.join(save_dir, tag)} in the background", ranks=[0])
        return True
    job = agreed(f"{what}: writing {save_dir}/{tag}", lambda: written(job), cleanup=discard)
    try:
        agreed(f"{what}: publishing {save_dir}/{tag}",   # flushed by make_durable below
               lambda: job.publish(durable=not files.FSYNC) if rank == 0 else None)
    except BaseException:
        job.close()
        raise
    if files.FSYNC:  # [Note: durable later]
        view.pending.put(PendingSave(job, durable_only=True))
    else:
        job.close()
    log_dist(f"Saved checkpoint {os.path.join(save_dir, tag)}", ranks=[0])
    return True


def _refuse_clashing_names(job: SaveJob, names: list[list[str]], discard: Callable[[], Any]) -> None:
    """Two ranks about to write the same file would overwrite each other's (and the staging rename
    then fails with an unrelated error): refuse by name, on every rank alike (all see `names`)."""
    owners: dict[str, list[int]] = {}
    for rank, mine in enumerate(names):
        for name in mine:
            owners.setdefault(name, []).append(rank)
    clashes = {name: ranks for name, ranks in owners.items() if len(ranks) > 1}
    if clashes:
        job.close()
        if job.rank == 0:
            discard()
        shown = "; ".join(f"{name} by ranks {ranks}" for name, ranks in sorted(clashes.items())[:4])
        raise files.CheckpointError(f"save_checkpoint: several ranks would write the same file ({shown}): their "
                                    "layout gives them the same mp_rank / dp_rank; nothing was written")


@_state_resident(dirty=False)
def optimizer_partition_state(view: CheckpointView) -> dict:
    """This rank's `optimizer_state_dict` as save_checkpoint writes it (ZeRO; collective)."""
    if autoep_zero3_io.uses_layout(view):   # [Note: AutoEP ZeRO-3 layout]
        hp = HpState(view)
        return autoep_zero3_io.optimizer_state(view, hp, autoep_zero3_io.file_groups(view, hp))
    if moe_io.is_moe_engine(view):   # [Note: MoE checkpoint layout]: named pieces, not DeepSpeed's flat groups
        return moe_io.pieces_state(view, HpState(view))
    cut = zero3_io.optimizer_state if view.stage3 is not None else partitioned_optimizer_state
    return cut(view, HpState(view), view.dp_rank, view.dp_world_size)


def _checked_tag(view: CheckpointView, save_dir: str, tag: Any) -> str:
    if not save_dir:
        raise ValueError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
    tag = f"global_step{view.counters.global_steps}" if tag is None else str(tag)
    if os.sep in tag or tag.startswith(".") or not tag:
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name")
    return tag


def wait_for_checkpoint(slot: PendingSlot) -> None:
    """Finish the engine's background save in `slot` ([Note: background save]); collective when one may
    be pending (every rank joins its writer thread, then all agree on the outcome)."""
    pending = slot.take()
    if pending is None:  # pending on every rank or on none: set only after an agreed snapshot
        return
    error = pending.join()
    if isinstance(error, PeerFailed):  # not this rank's failure: the failing rank reports its own
        error = None
    try:
        raise_if_any(error, f"save_checkpoint: writing {pending.job.save_dir}/{pending.job.tag} (in the background)",
                     cleanup=pending.job.discard)
    finally:
        pending.job.close()


def wait_local(slot: PendingSlot) -> None:
    """engine.destroy(): wait for this rank's background save in `slot` (no collective); raise its error."""
    pending = slot.take()
    if pending is not None and pending.join() is not None:
        pending.job.discard()
        pending.job.close()
        raise files.CheckpointError(f"background save_checkpoint of {pending.job.tag} failed on this rank: "
                                    f"{describe(pending.error)}") from pending.error


def state_version() -> str:
    from ...version import __version__

    return __version__


# --- load -------------------------------------------------------------------------------------
@_state_resident(dirty=True)
def load_checkpoint(view: CheckpointView, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
    ds_comm.arrive_and_wait("load_checkpoint", hint=_ALL_RANKS)
    wait_for_checkpoint(view.pending)
    wait_all_local()  # another engine of this process may still be writing what is read here
    plan = agreed("load_checkpoint", lambda: read_plan(view, load_dir, tag, load_module_strict,
                                                       load_optimizer_states, load_lr_scheduler_states,
                                                       load_module_only), none_ok=True)
    if plan is None:
        latest = "latest_universal" if view.load_universal else files.LATEST
        logger.warning(f"Unable to find latest file at {os.path.join(load_dir, latest)}; if trying to "
                       "load the latest checkpoint please pass an explicit tag or save one first.")
        return None, None
    if (plan.missing or plan.unexpected) and view.global_rank == 0:
        logger.warning(f"load_checkpoint({plan.reader.path}, load_module_strict=False): missing (kept as they "
                       f"are) {plan.missing}, unexpected (ignored) {plan.unexpected}")
    agreed("load_checkpoint: applying the checkpoint", lambda: apply_plan(view, plan))
    # collectives, on every rank alike: re-gather parameters from what was written locally
    if view.stage3 is not None:
        view.stage3.after_shard_update()
    if plan.hp is not None:
        plan.hp.refresh_model()
    reader = plan.reader
    state = reader.model_states
    client_state = {k: v for k, v in state.items() if k not in DEEPSPEED_KEYS}
    # DeepSpeed returns the model-states file this engine's layout reads (one per rank at ZeRO-3)
    zero3_files = view.stage3 is not None and (not moe_io.is_moe_engine(view)   # MoE: mp_rank_00 at any stage
                                                or autoep_zero3_io.uses_layout(view))
    name = files.model_file(view.mp_rank, zero3_dp_rank=view.dp_rank if zero3_files else None)
    path = os.path.join(load_dir, reader.tag, name)
    log_dist(f"Loaded checkpoint {reader.path} (saved by {reader.world_size} rank(s), stage {reader.stage})",
             ranks=[0])
    return path, client_state
