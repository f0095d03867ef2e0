# compat: upstream path deepspeed.runtime.precision_config (DeepSpeed 0.19.8 names).
"""The `fp16` / `bf16` config sections under their upstream names, and upstream's readers of
them from a raw config dict. The models live in deepspeed/runtime/config/sections/precision.py."""

from __future__ import annotations

from typing import Any

from .config.sections.precision import BF16Config, FP16Config
from .constants import BFLOAT16, BFLOAT16_OLD, FP16

DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config


def get_float16_config(param_dict: dict) -> FP16Config:
    """The validated `fp16` section of a raw config dict (defaults when absent)."""
    return FP16Config(**(param_dict.get(FP16) or {}))


def get_bfloat16_config(param_dict: dict) -> BF16Config:
    """The validated `bf16` section (legacy key `bfloat16` when `bf16` is absent)."""
    section: Any = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD)
    return BF16Config(**(section or {}))


def get_fp16_enabled(param_dict: dict) -> bool:
    return get_float16_config(param_dict).enabled


def get_bfloat16_enabled(param_dict: dict) -> bool:
    return get_bfloat16_config(param_dict).enabled


__all__ = ["DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config", "get_bfloat16_config",
           "get_fp16_enabled", "get_bfloat16_enabled"]
