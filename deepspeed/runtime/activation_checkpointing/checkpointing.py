"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API.

A façade: the state lives in `state.ActivationCheckpointing` owners (see [Note: one owner per
engine] in state.py), the regions in function.py, the kept inputs in stash.py, the RNG tracker in
rng.py. `configure()` configures the process-wide owner; `checkpoint()` runs under the current
one (an engine's own while its forward runs, else the process-wide one) and works unconfigured.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import state as _state
from .function import CheckpointFunction, non_reentrant_checkpoint, reentrant_checkpoint
from .rng import CudaRNGStatesTracker, seed_model_parallel
from .state import CheckpointingConfigError, CheckpointingSettings, CheckpointStats

__all__ = ["configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker", "CheckpointFunction", "settings", "stats",
           "CheckpointingConfigError", "CheckpointingSettings", "CheckpointStats"]


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Configure activation checkpointing for this process: the `activation_checkpointing`
    section of `deepspeed_config` (a DeepSpeedConfig, dict or JSON path), then every argument
    that is not None. Bad combinations raise CheckpointingConfigError and change nothing."""
    overrides = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
                 "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
                 "synchronize": synchronize, "profile": profile}

    def resolve() -> CheckpointingSettings:
        return _state.settings_from(deepspeed_config, overrides)

    group = getattr(mpu_, "get_model_parallel_group", None)
    if deepspeed_config is None or group is None:
        _state.PROCESS.configure(mpu_, resolve())
        return
    from ..agreement import agree_config

    # The model-parallel ranks gather each other's activation partitions: the same settings on all
    # of them, or the same error ([Note: cross-rank config agreement]). `synchronize` and `profile`
    # may differ: a device synchronisation and timing, local to the rank.
    settings = agree_config(resolve, "deepspeed.checkpointing.configure", group=group(), view=lambda s: {
        name: getattr(s, name) for name in ("partition_activations", "contiguous_checkpointing",
                                            "num_checkpoints", "checkpoint_in_cpu")})
    _state.PROCESS.configure(mpu_, settings)


def is_configured() -> bool:
    """True once `configure()` has run (DeepSpeed's `deepspeed_checkpointing_enabled`)."""
    return _state.PROCESS.configured


def settings() -> CheckpointingSettings:
    """A copy of the settings `checkpoint()` would use now."""
    return _state.current().settings.copy()


def stats() -> CheckpointStats:
    """The counters of the current owner (regions run, bytes kept, time spent)."""
    return _state.current().stats


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in
    backward (reentrant, as upstream). Tensors and non-tensors may be mixed in the arguments and
    the output; RNG states are replayed so dropout matches an uncheckpointed run exactly."""
    return reentrant_checkpoint(function, *args, **kwargs)


def reset() -> None:
    """Free the contiguous buffer's slots: call between forwards that have no backward."""
    _state.current().reset()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker of named generator states."""
    return _state.PROCESS.rng_tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the device generator with `seed` (same on all model-parallel ranks) and the tracker's
    'model-parallel-rng' state with seed + 2718 + model-parallel rank (same across data-parallel
    replicas). Call after configure(mpu) when model parallelism is used."""
    seed_model_parallel(_state.PROCESS.rng_tracker, seed, _state.current().mpu)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed only the tracker's 'model-parallel-rng' state (upstream helper)."""
    tracker = _state.PROCESS.rng_tracker
    states = tracker.get_states()
    states.pop("model-parallel-rng", None)
    tracker.set_states(states)
    mp_rank = _state.current().mpu.get_model_parallel_rank() if _state.current().mpu is not None else 0
    tracker.seeds_.discard(seed + 2718 + mp_rank)
    tracker.add("model-parallel-rng", seed + 2718 + mp_rank)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioning on or off after configure() (upstream helper)."""
    _state.PROCESS.settings.partition_activations = bool(partition_activation)


def set_num_layers(nlayers: int) -> None:
    """Set num_checkpoints after configure() (upstream helper)."""
    _state.PROCESS.settings.num_checkpoints = nlayers


def detach_variable(inputs: tuple) -> tuple:
    """Tensors detached, keeping requires_grad; other values as they are (upstream helper)."""
    return tuple(x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in inputs)


# Upstream's module globals, read-only, for code (and tests) that inspect them.
_UPSTREAM_GLOBALS = {
    "PARTITION_ACTIVATIONS": lambda o: o.settings.partition_activations,
    "CONTIGUOUS_CHECKPOINTING": lambda o: o.settings.contiguous_checkpointing,
    "num_layers": lambda o: o.settings.num_checkpoints,
    "CPU_CHECKPOINT": lambda o: o.settings.checkpoint_in_cpu,
    "SYNCHRONIZE": lambda o: o.settings.synchronize,
    "PROFILE_TIME": lambda o: o.settings.profile,
    "mpu": lambda o: o.mpu,
    "deepspeed_checkpointing_enabled": lambda o: o.configured,
}


def __getattr__(name: str) -> Any:
    if name in _UPSTREAM_GLOBALS:
        return _UPSTREAM_GLOBALS[name](_state.PROCESS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
