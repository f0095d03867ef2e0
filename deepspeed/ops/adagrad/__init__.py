# compat: upstream import path deepspeed.ops.adagrad
"""Adagrad for ZeRO-Offload: :class:`DeepSpeedCPUAdagrad`."""

from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
