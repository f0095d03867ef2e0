"""The owner of activation-checkpointing state: settings, mpu, buffer, RNG tracker, counters.

[Note: one owner per engine]
Upstream keeps this state in 17 module globals, so a second model in the process reconfigures
the first. Here it lives in `ActivationCheckpointing` objects. `deepspeed.checkpointing.configure()`
configures the process-wide one. An engine whose config has an `activation_checkpointing` section
builds its own and makes it *current* while its forward runs (`activated`); the regions record
the owner they ran under, so their recompute during backward uses the same settings whatever is
current then. The RNG tracker is the exception: named generator states are as process-wide as the
generators they stand in for, so every owner uses the process-wide tracker.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

from ...utils.logging import logger
from .rng import CudaRNGStatesTracker
from .stash import ContiguousBuffer, StashPlan


class CheckpointingConfigError(ValueError, AssertionError):
    """A bad combination of activation-checkpointing settings. A ValueError; also an
    AssertionError because upstream asserts, and callers written for it catch that."""


@dataclass
class CheckpointingSettings:
    """What `configure()` recorded; the defaults are DeepSpeed's."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False

    def copy(self) -> "CheckpointingSettings":
        return CheckpointingSettings(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class CheckpointStats:
    """Counters of the regions run under one owner (tests and benchmarks read them)."""

    forwards: int = 0
    recomputes: int = 0
    synchronizations: int = 0
    input_nbytes: int = 0       # full size of the tensor inputs of every region, summed
    kept_nbytes: int = 0        # what this rank actually kept of them
    forward_time_s: float = 0.0
    recompute_time_s: float = 0.0


def settings_from(deepspeed_config: Any, overrides: dict[str, Any]) -> CheckpointingSettings:
    """The config's `activation_checkpointing` section, then every override that is not None."""
    settings = CheckpointingSettings()
    if deepspeed_config is not None:
        section = _section_from(deepspeed_config)
        settings = CheckpointingSettings(
            partition_activations=section.partition_activations,
            contiguous_checkpointing=section.contiguous_memory_optimization,
            num_checkpoints=section.number_checkpoints,
            checkpoint_in_cpu=section.cpu_checkpointing,
            synchronize=section.synchronize_checkpoint_boundary,
            profile=section.profile)
    for name, value in overrides.items():
        if value is not None:
            setattr(settings, name, value if name == "num_checkpoints" else bool(value))
    _validate(settings)
    return settings


def _validate(s: CheckpointingSettings) -> None:
    where = "deepspeed.checkpointing.configure"
    if s.contiguous_checkpointing and not s.partition_activations:
        raise CheckpointingConfigError(
            f"{where}: contiguous_checkpointing (activation_checkpointing.contiguous_memory_optimization) "
            "requires partition_activations (activation_checkpointing.partition_activations=true)")
    if s.contiguous_checkpointing and s.num_checkpoints is None:
        raise CheckpointingConfigError(
            f"{where}: contiguous_checkpointing requires num_checkpoints (activation_checkpointing."
            "number_checkpoints), the number of layers checkpointed in one forward: it sizes the buffer")
    if s.num_checkpoints is not None and (not isinstance(s.num_checkpoints, int) or s.num_checkpoints < 1):
        raise CheckpointingConfigError(f"{where}: num_checkpoints (activation_checkpointing.number_checkpoints) "
                                       f"must be a positive integer; got {s.num_checkpoints!r}")


def _section_from(deepspeed_config: Any) -> Any:
    """The `activation_checkpointing` section of a DeepSpeedConfig, a dict or a JSON path."""
    model = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if model is not None:
        return model
    from ..config.loader import load_config_dict
    from ..config.sections.activation_checkpointing import ActivationCheckpointingConfig

    raw = load_config_dict(deepspeed_config).get("activation_checkpointing") or {}
    return ActivationCheckpointingConfig(**raw)


_KEEP_AS_IS = StashPlan()


class ActivationCheckpointing:
    """Settings, mpu, contiguous buffer and counters of activation checkpointing; see
    [Note: one owner per engine]."""

    def __init__(self, rng_tracker: Optional[CudaRNGStatesTracker] = None) -> None:
        self.settings = CheckpointingSettings()
        self.mpu: Any = None
        self.configured = False
        self.rng_tracker = rng_tracker if rng_tracker is not None else CudaRNGStatesTracker()
        self.buffer: Optional[ContiguousBuffer] = None
        self.stats = CheckpointStats()

    def configure(self, mpu: Any, settings: CheckpointingSettings) -> None:
        self.settings, self.mpu, self.configured = settings.copy(), mpu, True
        self.buffer = ContiguousBuffer(settings.num_checkpoints) if settings.contiguous_checkpointing else None
        logger.debug(f"deepspeed.checkpointing configured: {settings}")

    def reset(self) -> None:
        """Free the contiguous buffer's slots (upstream's reset(); eval without backward)."""
        if self.buffer is not None:
            self.buffer.reset()

    def stash_plan(self) -> StashPlan:
        s, mpu = self.settings, self.mpu
        if not (s.partition_activations or s.checkpoint_in_cpu):
            return _KEEP_AS_IS
        mp_size = mpu.get_model_parallel_world_size() if (s.partition_activations and mpu is not None) else 1
        if mp_size <= 1:
            return StashPlan(to_cpu=s.checkpoint_in_cpu)
        return StashPlan(mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mp_size,
                         s.checkpoint_in_cpu, self.buffer)

    def synchronize(self) -> None:
        """Device synchronisation at a region boundary, when `synchronize` is set."""
        if self.settings.synchronize:
            from ...accelerator import get_accelerator

            get_accelerator().synchronize()
            self.stats.synchronizations += 1

    @contextlib.contextmanager
    def phase(self, name: str, label: str) -> Iterator[None]:
        """One forward or recompute of a region: boundary synchronisation, counting, profiling."""
        self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            elapsed = time.perf_counter() - start
            if name == "forward":
                self.stats.forwards += 1
                self.stats.forward_time_s += elapsed
            else:
                self.stats.recomputes += 1
                self.stats.recompute_time_s += elapsed
            if self.settings.profile:
                logger.info(f"activation checkpointing: {name} of {label} took {elapsed * 1e3:.3f} ms")

    def record_kept(self, input_nbytes: int, kept_nbytes: int) -> None:
        self.stats.input_nbytes += input_nbytes
        self.stats.kept_nbytes += kept_nbytes


PROCESS = ActivationCheckpointing()
"""The owner `deepspeed.checkpointing.configure()` configures; current outside engine forwards."""

_CURRENT: contextvars.ContextVar[Optional[ActivationCheckpointing]] = contextvars.ContextVar(
    "deepspeed_activation_checkpointing", default=None)


def current() -> ActivationCheckpointing:
    """The owner a `checkpoint()` call made now runs under."""
    owner = _CURRENT.get()
    return owner if owner is not None else PROCESS


def for_engine(config: Any, mpu: Any) -> Optional[ActivationCheckpointing]:
    """An engine's own owner when its config has an `activation_checkpointing` section, else None
    (then `configure()`'s process-wide settings apply inside its forward too)."""
    model = getattr(config, "model", None)
    if model is None or "activation_checkpointing" not in model.model_fields_set:
        return None
    owner = ActivationCheckpointing(rng_tracker=PROCESS.rng_tracker)
    owner.configure(mpu, settings_from(config, {}))
    return owner


@contextlib.contextmanager
def activated(owner: Optional[ActivationCheckpointing]) -> Iterator[None]:
    """Make `owner` current for the block (no-op for None)."""
    if owner is None:
        yield
        return
    token = _CURRENT.set(owner)
    try:
        yield
    finally:
        _CURRENT.reset(token)
