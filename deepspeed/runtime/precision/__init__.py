"""Mixed precision: loss scalers (this package owns the fp16 loss scale)."""

from .loss_scaler import (BaseScaler, DynamicScaler, LossScaleAtMinimumError, NoScaler, StaticScaler, make_scaler,
                          scaler_from_state_dict)

__all__ = ["BaseScaler", "DynamicScaler", "LossScaleAtMinimumError", "NoScaler", "StaticScaler", "make_scaler",
           "scaler_from_state_dict"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
