"""Precision sections: `fp16`, `bf16` (legacy key `bfloat16`), `torch_autocast`, `data_types`.

Defaults are DeepSpeed 0.19.8's (runtime/precision_config.py, runtime/constants.py).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import torch
from pydantic import Field, field_serializer, field_validator
from pydantic_core import PydanticCustomError

from .base import DSModel, DtypeName, Float, Int, Problem, TORCH_DTYPES, canonical_dtype

MAX_SCALE_POWER = 127  # 2**127 is the largest power of two a float32 loss scale can hold


class FP16Config(DSModel):
    """`fp16`: fp16 weights and activations, fp32 master weights, loss scaling."""

    enabled: bool = False
    """Train with fp16 parameters (mixed precision)."""
    auto_cast: bool = False
    """Cast floating-point inputs of forward() to fp16."""
    loss_scale: Float = Field(0.0, ge=0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: Int = Field(16, ge=0, le=MAX_SCALE_POWER)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Int = 1000
    """Overflow-free steps before the dynamic scale is raised."""
    hysteresis: Int = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale is lowered (delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill hysteresis on every overflow-free step instead of only when the scale rises."""
    min_loss_scale: Int = 1
    """Lower bound of the dynamic loss scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (upstream: ZeRO + CPU Adam only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_number(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple, dict, set)) or value is None:
            raise PydanticCustomError("ds_expected", "must be a number (0: dynamic loss scaling), got {kind}",
                                      {"kind": type(value).__name__})
        return value

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)

    def _problems(self) -> Iterator[Problem]:
        # Like upstream, the dynamic-scaling knobs are checked only when they take effect, so a
        # static-scale config carrying unused values still loads.
        if self.enabled and self.dynamic:
            if self.loss_scale_window < 1:
                yield "loss_scale_window", f"got {self.loss_scale_window}; must be >= 1 with dynamic loss scaling"
            if self.min_loss_scale <= 0:
                yield "min_loss_scale", f"got {self.min_loss_scale}; must be > 0 with dynamic loss scaling"


class BF16Config(DSModel):
    """`bf16` (legacy top-level key `bfloat16`): bf16 weights and activations, no loss scaling."""

    enabled: bool = False
    """Train with bf16 parameters (mixed precision)."""
    immediate_grad_update: bool = False
    """Apply each gradient to the fp32 accumulator as soon as it is produced."""
    check_grad_overflow: bool = True
    """Skip the optimizer step when a gradient is inf/nan (0.19.8 turned this on by default)."""
    bf16_master_weights_and_grads: bool = False
    """Keep ZeRO master weights and gradients in bf16 instead of fp32 (ZeRO stages 1-3)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16; needs bf16_master_weights_and_grads."""

    def _problems(self) -> Iterator[Problem]:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            yield "bf16_optimizer_states", "requires bf16_master_weights_and_grads: true"


def _autocast_dtype(value: Any) -> Optional[torch.dtype]:
    name = canonical_dtype(value, allowed=("fp16", "bf16"))
    return None if name is None else TORCH_DTYPES[name]


class TorchAutocastConfig(DSModel):
    """`torch_autocast`: run forward under torch.autocast while parameters stay fp32."""

    enabled: bool = False
    """Wrap the engine's forward in torch.autocast."""
    dtype: Optional[torch.dtype] = None
    """Autocast dtype: "bfloat16"/"bf16"/"float16"/"fp16" (None: torch's device default)."""
    lower_precision_safe_modules: Optional[list[str]] = None
    """Dotted class names whose parameters may be communicated in the autocast dtype."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _parse_dtype(cls, value: Any) -> Optional[torch.dtype]:
        return _autocast_dtype(value)

    @field_serializer("dtype")
    def _dtype_name(self, value: Optional[torch.dtype]) -> Optional[str]:
        return None if value is None else str(value).replace("torch.", "")


def param_dtype_conflict(param_dtype: Optional[str], fp16: bool, bf16: bool) -> Optional[str]:
    """Why `data_types.param_dtype` contradicts the fp16/bf16 flags (None when it does not)."""
    mode = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if param_dtype is None or param_dtype == mode:
        return None
    return (f"{param_dtype!r} conflicts with the training precision {mode!r} (from the fp16/bf16 enabled "
            f"flags); omit it or make it match")


class DataTypesConfig(DSModel):
    """`data_types`: dtypes that differ from the training precision."""

    grad_accum_dtype: DtypeName = None
    """Dtype gradients are accumulated in ("fp32", "fp16", "bf16"; None: follow precision)."""
    param_dtype: DtypeName = None
    """Cast parameters to this dtype (None: the mixed-precision dtype)."""
    buffer_dtype: DtypeName = None
    """Cast buffers to this dtype (None: keep the dtype they were loaded with)."""
    keep_in_fp32_modules: Any = "auto"
    """Name patterns of modules whose buffers stay fp32 ("auto": the model's own list)."""

    @field_validator("keep_in_fp32_modules", mode="before")
    @classmethod
    def _auto_or_list(cls, value: Any) -> Union[list[str], str]:
        if value == "auto" or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        raise PydanticCustomError("ds_expected", 'expected "auto" or a list of module name patterns')
