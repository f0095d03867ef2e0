"""Outcomes that only some ranks see, turned into one result (or one error) on every rank.

[Note: agreed errors]
Runtime calls alternate local work (reading or writing files, loading and validating a config,
building state) with collectives. A failure that only one rank sees (its shard file is missing
or corrupt, its disk is full, its config file does not parse) must not let that rank raise
while the others walk into the next collective and wait there for the backend's timeout. So a
local phase runs under `agreed`: the phase's exception is caught, one small all-reduce (`vote`:
five int64 maxima) tells every rank whether any rank failed (and whether the ranks' digests of
what they computed differ), and only then (on failure only) the failing ranks' messages are
exchanged, so every rank raises the caller's error type naming each failing rank and its error
(`.failures`: {rank: message}); the failing rank's own exception is chained as the cause. When
every rank failed with the same error (a missing tag on a shared file system, one bad config
given to all), that error is raised as it is. The all-reduce runs on the calling (main) thread,
like every collective. Used by the checkpoint calls (checkpoint/agree.py) and by the config
agreement below ([Note: cross-rank config agreement] in config/agreement.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, NoReturn, TypeVar

import torch

from .. import comm as ds_comm

T = TypeVar("T")
_NONE = object()
_AGREED_CONFIGS: "weakref.WeakSet[Any]" = weakref.WeakSet()   # DeepSpeedConfigs already agreed (world group)


class Vote(NamedTuple):
    failed: bool      # some rank failed
    mixed_none: bool  # some ranks found nothing to do and others did not
    differ: bool      # the ranks' digests differ


def distributed(group: Any = None) -> bool:
    return ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1


def vote(failed: bool, none: bool = False, digest: int = 0, group: Any = None) -> Vote:
    """One all-reduce (MAX) of [failed, none, -none, digest, -digest]: any failure, a mix of
    None and not None, and unequal digests (max != min) in one small collective."""
    values = [int(failed), int(none), -int(none), digest, -digest]
    if not distributed(group):
        return Vote(failed, False, False)
    flags = torch.tensor(values, dtype=torch.int64, device=ds_comm.collective_device(group))
    ds_comm.all_reduce(flags, op=ds_comm.ReduceOp.MAX, group=group)
    most = flags.tolist()
    return Vote(most[0] > 0, most[1] == 1 and most[2] == 0, most[3] != -most[4])


def gather(obj: Any, group: Any = None) -> dict[int, Any]:
    """{global rank: its `obj`}: every rank's object (all_gather_object; run only on failure)."""
    if not distributed(group):
        return {ds_comm.get_rank(): obj}
    objects: list[Any] = [None] * ds_comm.get_world_size(group)
    ds_comm.all_gather_object(objects, obj, group=group)
    return {ds_comm.get_global_rank(group, i): o for i, o in enumerate(objects)}


def describe(error: BaseException, error_type: type = type(None)) -> str:
    return str(error) if isinstance(error, error_type) else f"{type(error).__name__}: {error}"


def agreed(what: str, fn: Callable[[], T], error_type: type, cleanup: Callable[[], Any] | None = None,
           none_ok: bool = False, group: Any = None) -> T:
    """Run the local phase `fn` on this rank, then agree: raise on every rank if any rank failed.

    With `none_ok`, `fn` may return None ("nothing to do", e.g. no `latest` file): every rank
    must then return None, and a rank that got None while others did not is an error too."""
    result: Any = _NONE
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    none = result is None and error is None
    outcome = vote(error is not None, none=none, group=group)
    if not outcome.failed and none_ok and outcome.mixed_none:
        error_text = "found nothing to do (no `latest` file?) while other ranks went on" if none else None
        raise_agreed(what, error_text, None, error_type, cleanup, prefix="ranks disagree", group=group)
    if outcome.failed:
        raise_agreed(what, describe(error, error_type) if error is not None else None, error, error_type, cleanup,
                     group=group)
    return result


def raise_agreed(what: str, mine: str | None, error: BaseException | None, error_type: type,
                 cleanup: Callable[[], Any] | None = None, prefix: str = "failed", group: Any = None,
                 texts: dict[int, Any] | None = None) -> NoReturn:
    """The error every rank raises once a vote found a failure: `mine` is this rank's message
    (None: this rank succeeded); every rank's message is gathered (unless `texts` has them
    already) and named by rank. `cleanup` runs on every rank: no partial file stays behind on
    node-local storage either."""
    rank = ds_comm.get_rank() if distributed(group) else 0
    texts = gather(mine, group) if texts is None else texts
    if cleanup is not None:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
    failures = {r: t for r, t in texts.items() if t is not None}
    if len(failures) == len(texts) and len(set(failures.values())) == 1:
        if error is not None:  # every rank saw the same: raise it as it is (its type: ValueError for a bad argument)
            try:
                error.failures = failures
            except AttributeError:   # an exception type without instance attributes
                pass
            raise error
        detail = next(iter(failures.values())) + (" (on every rank)" if len(texts) > 1 else "")
    else:
        detail = "; ".join(f"rank {r}: {t}" for r, t in failures.items())
        if mine is None:
            detail += f" (this is rank {rank}, which succeeded but stops too)"
    agreed_error = error_type(f"{what} {prefix}: {detail}")
    agreed_error.failures = failures  # {rank: its error}
    raise agreed_error from error


def agree_config(config: Any, what: str, group: Any = None, view: Callable[[Any], dict] | None = None) -> Any:
    """The same config on every rank of `group` (None: the world), or the same error on every rank.

    `config` is the value to agree (a DeepSpeedConfig unless `view` says how to see it) or a
    callable building it: it runs here, so a rank whose config fails to load or validate makes
    every rank raise. A DeepSpeedConfig agreed over the world once is not agreed again (the
    engine's constructor after deepspeed.initialize). One all-reduce; see
    [Note: cross-rank config agreement]."""
    from .config.agreement import agreement_view, describe as describe_diff, differences, digest
    from .config.errors import ConfigMismatchError, DeepSpeedConfigError

    if not callable(config) and group is None and config in _AGREED_CONFIGS:
        return config
    view = view or (lambda c: agreement_view(resolved_config(c)))
    error: BaseException | None = None
    mine: dict | None = None
    try:
        config = config() if callable(config) else config
        mine = view(config)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    outcome = vote(error is not None, digest=digest(mine) if mine is not None else 0, group=group)
    if outcome.failed:
        raise_agreed(f"{what}:", describe(error, DeepSpeedConfigError) if error is not None else None, error,
                     DeepSpeedConfigError, prefix="the config failed to load or validate", group=group)
    if outcome.differ:
        diff = differences(gather(mine, group))
        raise ConfigMismatchError(what, describe_diff(diff), diff)
    if group is None:
        try:
            _AGREED_CONFIGS.add(config)
        except TypeError:   # not weakly referenceable (a plain dict): agreed again next time
            pass
    return config


def resolved_config(config: Any) -> dict:
    """A DeepSpeedConfig's resolved values, with the optimizer named as the engine resolves it
    (DeepSpeed's names case-insensitively: "adamw" and "AdamW" build the same optimizer)."""
    resolved = config.to_dict()
    optimizer = config.model.optimizer
    if optimizer is not None and isinstance(resolved.get("optimizer"), dict):
        resolved["optimizer"]["type"] = optimizer.name
    return resolved
