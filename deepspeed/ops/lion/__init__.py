# compat: upstream import path deepspeed.ops.lion
"""Lion optimizers: :class:`FusedLion` (any device) and :class:`DeepSpeedCPULion` (ZeRO-Offload)."""

from .lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
