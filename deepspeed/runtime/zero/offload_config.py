# compat: upstream path deepspeed.runtime.zero.offload_config (DeepSpeed 0.19.8 names).
"""`offload_param` / `offload_optimizer` config classes and the offload enums.

The models live in deepspeed/runtime/config/sections/offload.py. Their `device` reads back as a
plain string ("none", "cpu", "nvme"), as upstream's (its models use enum values); the enum is a
`str` enum, so `config.device == OffloadDeviceEnum.cpu` and `OffloadDeviceEnum.cpu == "cpu"` both
hold and an enum member is accepted wherever a device string is.
"""

from enum import Enum

from ..config.sections.offload import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """Where ZeRO offloads to: `zero_optimization.offload_param/offload_optimizer.device`."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Kinds of training state `engine.offload_states(include=...)` moves (see offload_states.py)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig"]
