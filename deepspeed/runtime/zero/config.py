# compat: upstream path deepspeed.runtime.zero.config (DeepSpeed 0.19.8 names).
"""The `zero_optimization` config classes under their upstream names and import path.

The models live in deepspeed/runtime/config/sections/zero.py and offload.py; only
`ZeroStageEnum` is defined here.
"""

from enum import Enum

from ..config.sections.offload import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
from ..config.sections.zero import DeepSpeedZeroConfig, DeepSpeedZeroLeafModuleConfig

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """ZeRO stages by what they shard (`zero_optimization.stage`); compares equal to the int."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights`, as upstream


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "DeepSpeedZeroLeafModuleConfig", "ZeroStageEnum", "ZERO_OPTIMIZATION"]
