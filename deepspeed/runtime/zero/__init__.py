"""ZeRO: the sharding core shared by stages 1-3; also `deepspeed.zero` (upstream exposes this
package under that name). Its public names resolve lazily, so importing a submodule stays cheap."""

from __future__ import annotations

import importlib
from typing import Any

from ..._lazy import import_submodule

_PUBLIC = ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "unwrap_model_for_generation")

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        return import_submodule(__name__, name)   # deepspeed.zero.partition_parameters, ...
    home = ".generation" if name == "unwrap_model_for_generation" else ".partition_parameters"
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
