# compat: upstream import path deepspeed.ops.adam
"""Adam optimizers: :class:`FusedAdam` (any device) and :class:`DeepSpeedCPUAdam` (ZeRO-Offload)."""

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
