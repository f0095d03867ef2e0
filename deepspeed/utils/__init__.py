# compat: upstream `deepspeed.utils` names, resolved lazily.
from __future__ import annotations

import importlib
from typing import Any

from .._lazy import import_submodule

from .logging import log_dist, logger, print_dist, set_log_level_from_string, warning_once

# Eager, as upstream: importing the submodule binds `deepspeed.utils.z3_leaf_module` to the module,
# and this import then rebinds it to the function of the same name, whoever imported it first.
from .z3_leaf_module import (apply_zero_leaf_module_config, get_z3_leaf_modules, set_z3_leaf_module,  # noqa: E402
                             set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                             unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

_LAZY = {
    "is_initialized": ("deepspeed.comm.comm", "is_initialized"),
    "RepeatingLoader": ("deepspeed.runtime.dataloader", "RepeatingLoader"),
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "SynchronizedWallClockTimer": ("deepspeed.utils.timer", "SynchronizedWallClockTimer"),
    "ThroughputTimer": ("deepspeed.utils.timer", "ThroughputTimer"),
    "safe_get_full_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_get_full_fp32_param"),
    "safe_set_full_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_set_full_fp32_param"),
    "safe_get_full_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_get_full_optimizer_state"),
    "safe_set_full_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_set_full_optimizer_state"),
    "safe_get_full_grad": ("deepspeed.utils.tensor_fragment", "safe_get_full_grad"),
    "safe_set_full_grad": ("deepspeed.utils.tensor_fragment", "safe_set_full_grad"),
    "safe_update_full_grad_vectorized": ("deepspeed.utils.tensor_fragment", "safe_update_full_grad_vectorized"),
    "safe_get_local_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_get_local_fp32_param"),
    "safe_set_local_fp32_param": ("deepspeed.utils.tensor_fragment", "safe_set_local_fp32_param"),
    "safe_get_local_grad": ("deepspeed.utils.tensor_fragment", "safe_get_local_grad"),
    "safe_set_local_grad": ("deepspeed.utils.tensor_fragment", "safe_set_local_grad"),
    "safe_get_local_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_get_local_optimizer_state"),
    "safe_set_local_optimizer_state": ("deepspeed.utils.tensor_fragment", "safe_set_local_optimizer_state"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        return import_submodule(__name__, name)   # deepspeed.utils.zero_to_fp32, ...
    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
