# compat: upstream `deepspeed.utils` names, resolved lazily.
from __future__ import annotations

import importlib
from typing import Any

from .logging import log_dist, logger, print_dist, warning_once

_LAZY = {
    "RepeatingLoader": ("deepspeed.runtime.dataloader", "RepeatingLoader"),
    "SynchronizedWallClockTimer": ("deepspeed.utils.timer", "SynchronizedWallClockTimer"),
    "ThroughputTimer": ("deepspeed.utils.timer", "ThroughputTimer"),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
