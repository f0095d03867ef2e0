"""`deepspeed.checkpointing`: configuration only, for now.

`configure()` takes DeepSpeed 0.19.8's arguments, validates them and records them on one owner
object (`_STATE`). Lightning's DeepSpeedStrategy calls it on every run, because its default config
always has an `activation_checkpointing` section. Activation checkpointing itself
(`checkpoint()`, partitioned/CPU activations, the model-parallel RNG tracker) is not implemented:
`checkpoint()` raises and names the alternative (`torch.utils.checkpoint.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ...utils.logging import logger


@dataclass
class CheckpointingSettings:
    """What `configure()` recorded; the defaults are DeepSpeed's."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


class _CheckpointingState:
    """The one owner of activation-checkpointing state (DESIGN: no module globals)."""

    def __init__(self) -> None:
        self.settings = CheckpointingSettings()
        self.mpu: Any = None
        self.configured = False

    def configure(self, mpu_: Any, deepspeed_config: Any, overrides: dict[str, Any]) -> None:
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
        for name, value in overrides.items():  # None: keep the config's (or the default) value
            if value is not None:
                setattr(settings, name, value if name == "num_checkpoints" else bool(value))
        if settings.contiguous_checkpointing and not settings.partition_activations:
            raise ValueError("deepspeed.checkpointing.configure: contiguous_checkpointing (contiguous memory "
                             "optimization) requires partition_activations")
        if settings.contiguous_checkpointing and settings.num_checkpoints is None:
            raise ValueError("deepspeed.checkpointing.configure: contiguous_checkpointing requires "
                             "num_checkpoints (activation_checkpointing.number_checkpoints)")
        self.settings, self.mpu, self.configured = settings, mpu_, True
        logger.debug(f"deepspeed.checkpointing configured: {settings}")


def _section_from(deepspeed_config: Any):
    """The `activation_checkpointing` section of a DeepSpeedConfig, a dict or a JSON path."""
    model = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if model is not None:
        return model
    from ..config.loader import load_config_dict
    from ..config.sections.activation_checkpointing import ActivationCheckpointingConfig
    raw = load_config_dict(deepspeed_config).get("activation_checkpointing") or {}
    return ActivationCheckpointingConfig(**raw)


_STATE = _CheckpointingState()


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Record the activation-checkpointing settings: those of `deepspeed_config` (a DeepSpeedConfig,
    dict or JSON path), then every argument that is not None."""
    overrides = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
                 "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
                 "synchronize": synchronize, "profile": profile}
    _STATE.configure(mpu_, deepspeed_config, overrides)


def is_configured() -> bool:
    """True once `configure()` has run (DeepSpeed's `deepspeed_checkpointing_enabled`)."""
    return _STATE.configured


def settings() -> CheckpointingSettings:
    """A copy of the recorded settings."""
    return CheckpointingSettings(**{f.name: getattr(_STATE.settings, f.name) for f in fields(CheckpointingSettings)})


def checkpoint(function: Any, *args: Any) -> Any:
    """Not implemented here: DeepSpeed's activation checkpointing."""
    raise NotImplementedError(
        "deepspeed.checkpointing.checkpoint (activation checkpointing) is not implemented by this pure-Python "
        "DeepSpeed; only deepspeed.checkpointing.configure() is. Use torch.utils.checkpoint.checkpoint(function, "
        "*args, use_reentrant=False) instead: it works with every ZeRO stage here.")
