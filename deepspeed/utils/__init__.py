# compat: upstream `deepspeed.utils` names, resolved lazily.
from __future__ import annotations

import importlib
from typing import Any

from .logging import log_dist, logger, print_dist, warning_once

_LAZY = {
    "RepeatingLoader": ("deepspeed.runtime.dataloader", "RepeatingLoader"),
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
    **{name: ("deepspeed.utils.z3_leaf_module", name) for name in (
        "z3_leaf_module", "z3_leaf_parameter", "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
        "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
        "apply_zero_leaf_module_config")},
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = getattr(module, attr)
    globals()[name] = value
    # importing a submodule binds its name on this package; upstream exports a function of the
    # same name (deepspeed.utils.z3_leaf_module), which must win, as its eager import makes it
    short = module_name.rsplit(".", 1)[-1]
    if short in _LAZY and _LAZY[short][0] == module_name:
        globals()[short] = getattr(module, _LAZY[short][1])
    return value
