# compat: upstream's module-level config readers of deepspeed.runtime.config (DeepSpeed 0.19.8).
"""`get_<key>(param_dict)`: one top-level value of a raw config dict, or its default.

Like upstream these read the dict as given (no validation: DeepSpeedConfig validates); the
keys and defaults are deepspeed.runtime.constants'. Engine code reads the typed config instead.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import constants as C


def _getter(key: str, default: Any) -> Callable[[dict], Any]:
    def get(param_dict: dict) -> Any:
        return param_dict.get(key, default)

    get.__name__ = get.__qualname__ = f"get_{key}"
    get.__doc__ = f"param_dict[{key!r}], default {default!r}."
    return get


get_train_batch_size = _getter(C.TRAIN_BATCH_SIZE, C.TRAIN_BATCH_SIZE_DEFAULT)
get_train_micro_batch_size_per_gpu = _getter(C.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
                                             C.TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT)
get_gradient_accumulation_steps = _getter(C.GRADIENT_ACCUMULATION_STEPS, C.GRADIENT_ACCUMULATION_STEPS_DEFAULT)
get_gradient_clipping = _getter(C.GRADIENT_CLIPPING, C.GRADIENT_CLIPPING_DEFAULT)
get_log_level = _getter(C.LOG_LEVEL, C.LOG_LEVEL_DEFAULT)
get_steps_per_print = _getter(C.STEPS_PER_PRINT, C.STEPS_PER_PRINT_DEFAULT)
get_prescale_gradients = _getter(C.PRESCALE_GRADIENTS, C.PRESCALE_GRADIENTS_DEFAULT)
get_gradient_predivide_factor = _getter(C.GRADIENT_PREDIVIDE_FACTOR, C.GRADIENT_PREDIVIDE_FACTOR_DEFAULT)
get_wall_clock_breakdown = _getter(C.WALL_CLOCK_BREAKDOWN, C.WALL_CLOCK_BREAKDOWN_DEFAULT)
get_memory_breakdown = _getter(C.MEMORY_BREAKDOWN, C.MEMORY_BREAKDOWN_DEFAULT)
get_dump_state = _getter(C.DUMP_STATE, C.DUMP_STATE_DEFAULT)
get_dataloader_drop_last = _getter(C.DATALOADER_DROP_LAST, C.DATALOADER_DROP_LAST_DEFAULT)
get_zero_allow_untested_optimizer = _getter(C.ZERO_ALLOW_UNTESTED_OPTIMIZER, C.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT)


def _section_value(param_dict: dict, section: str, key: str, default: Any) -> Any:
    value = param_dict.get(section)
    return value.get(key, default) if isinstance(value, dict) and C.TYPE in value else default


def get_optimizer_name(param_dict: dict) -> Any:
    return _section_value(param_dict, C.OPTIMIZER, C.TYPE, C.OPTIMIZER_TYPE_DEFAULT)


def get_optimizer_params(param_dict: dict) -> Any:
    return _section_value(param_dict, C.OPTIMIZER, C.OPTIMIZER_PARAMS, None)


def get_scheduler_name(param_dict: dict) -> Any:
    return _section_value(param_dict, C.SCHEDULER, C.TYPE, C.SCHEDULER_TYPE_DEFAULT)


def get_scheduler_params(param_dict: dict) -> Any:
    return _section_value(param_dict, C.SCHEDULER, C.SCHEDULER_PARAMS, None)


__all__ = [name for name in dict(globals()) if name.startswith("get_")]
