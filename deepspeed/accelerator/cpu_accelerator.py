# compat: upstream path deepspeed.accelerator.cpu_accelerator (DeepSpeed 0.19.8 names).
"""Upstream keeps each accelerator class in its own module; code imports it from there."""

from .real_accelerator import CPU_Accelerator

__all__ = ["CPU_Accelerator"]
