"""PrecisionPolicy: every dtype decision of a run, made once from the config.

Which dtype each tensor is in (see docs/precision.md):

| config            | params (compute) | master weights | grad accumulation | reduce (comm) default |
|-------------------|------------------|----------------|-------------------|-----------------------|
| fp32              | fp32             | = params       | fp32              | fp32                  |
| fp16              | fp16             | fp32           | fp32              | fp16                  |
| bf16              | bf16             | fp32           | fp32              | bf16                  |
| torch_autocast    | fp32 (autocast)  | = params       | fp32              | autocast dtype for the safe modules' params, else fp32 |
| fp16/bf16 + `*_master_weights_and_grads` (ZeRO) | fp16/bf16 | fp16/bf16 | fp16/bf16 | fp16/bf16 |

`data_types.grad_accum_dtype` and `communication_data_type` override their columns. The loss
scaler is dynamic or static for fp16 (and for torch_autocast in float16), absent otherwise.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from .master_weights import master_weights_dtype
from .loss_scaler import BaseScaler, DynamicScaler, NoScaler, make_scaler

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype            # the model's parameters and activations
    master_dtype: torch.dtype           # what the optimizer updates
    grad_accum_dtype: torch.dtype       # where gradients accumulate across micro-steps
    comm_dtype_override: torch.dtype | None
    autocast_dtype: torch.dtype | None  # torch_autocast: forward runs under torch.autocast(dtype)
    fp16_section: Any = None            # the fp16 config section when a loss scaler is needed
    autocast_safe_modules: tuple[str, ...] | None = None
    cast_inputs: bool = False           # fp16.auto_cast: floating inputs are cast to fp16
    check_grad_overflow: bool = False   # bf16.check_grad_overflow: skip steps with inf/nan gradients

    @classmethod
    def from_config(cls, config: Any) -> "PrecisionPolicy":
        model = config.model
        accum = _DTYPES.get(model.data_types.grad_accum_dtype or "", None)
        # low-precision ZeRO masters (master_weights.py): masters and gradients in that dtype
        low = master_weights_dtype(model)
        master = low or torch.float32
        if model.fp16.enabled:
            return cls(torch.float16, master, accum or master, config.communication_dtype, None,
                       fp16_section=model.fp16, cast_inputs=bool(model.fp16.auto_cast))
        if model.bf16.enabled:
            return cls(torch.bfloat16, master, accum or master, config.communication_dtype, None,
                       check_grad_overflow=bool(model.bf16.check_grad_overflow))
        if model.torch_autocast.enabled:
            dtype = model.torch_autocast.dtype or torch.bfloat16
            safe = model.torch_autocast.lower_precision_safe_modules
            fp16 = _autocast_fp16_section(model) if dtype == torch.float16 else None
            return cls(torch.float32, torch.float32, accum or torch.float32, config.communication_dtype, dtype,
                       fp16_section=fp16, autocast_safe_modules=tuple(safe) if safe is not None else None)
        return cls(torch.float32, torch.float32, accum or torch.float32, config.communication_dtype, None)

    # --- derived decisions ------------------------------------------------------------------
    @property
    def needs_master_copy(self) -> bool:
        """True when the optimizer must update a separate higher-precision copy of each param."""
        return self.master_dtype != self.param_dtype

    @property
    def needs_scaler(self) -> bool:
        return self.fp16_section is not None

    @property
    def check_overflow(self) -> bool:
        """Whether each step looks for inf/nan gradients (one all-reduce of a flag) and skips."""
        return self.needs_scaler or self.check_grad_overflow

    @property
    def grads_bound_to_params(self) -> bool:
        """Gradients can live in `param.grad` (same dtype) rather than in separate buffers."""
        return self.grad_accum_dtype == self.param_dtype

    @property
    def is_mixed(self) -> bool:
        return self.needs_master_copy or self.needs_scaler or not self.grads_bound_to_params

    def make_scaler(self) -> BaseScaler:
        return make_scaler(self.fp16_section) if self.fp16_section is not None else NoScaler()

    def comm_dtype_fn(self) -> Callable[[torch.nn.Parameter], torch.dtype]:
        """Per-parameter reduce dtype: the override, else the autocast rule, else the param dtype."""
        if self.comm_dtype_override is not None:
            forced = self.comm_dtype_override
            return lambda p: forced
        if self.autocast_dtype is not None:
            from ..torch_autocast import get_comm_dtype

            return lambda p: get_comm_dtype(p)
        return lambda p: p.dtype

    def forward_context(self, device_type: str) -> ContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def cast_input(self, value: Any) -> Any:
        """fp16.auto_cast: floating-point tensors of a forward's inputs become fp16."""
        if not self.cast_inputs:
            return value
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.param_dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_input(v) for v in value)
        if isinstance(value, dict):
            return {k: self.cast_input(v) for k, v in value.items()}
        return value


def _autocast_fp16_section(model: Any) -> Any:
    """torch_autocast in float16 needs a dynamic scaler; the fp16 section's scaler keys configure it."""
    return model.fp16.model_copy(update={"loss_scale": 0.0}) if model.fp16.loss_scale else model.fp16


__all__ = ["PrecisionPolicy", "DynamicScaler"]
