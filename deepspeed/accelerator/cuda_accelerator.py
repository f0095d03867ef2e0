# compat: upstream path deepspeed.accelerator.cuda_accelerator (DeepSpeed 0.19.8 names).
"""Upstream keeps each accelerator class in its own module; code imports it from there."""

from .real_accelerator import CUDA_Accelerator

__all__ = ["CUDA_Accelerator"]
