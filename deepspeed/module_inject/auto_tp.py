"""AutoTP: replace a model's Linear layers by tensor-parallel ones following its plan (tp_plan.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers import LinearAllreduce, LinearLayer, tensor_parallel_size
from .tp_plan import COLUMN, ROW, build_plan, summary


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def shard_model(model: nn.Module, tp_size: int, tp_config: dict | None, group: Any) -> dict[str, list[str]]:
    """Shard `model` in place for `tp_size` ranks over `group` ([Note: the AutoTP plan]); returns the
    plan's summary {kind: [layer names]}. A model already sharded for `tp_size` is left as it is."""
    have = tensor_parallel_size(model)
    if have == tp_size:
        return {}
    if have != 1:
        raise ValueError(f"AutoTP: the model is already sharded for tensor-parallel size {have}, not {tp_size}")
    plan = build_plan(model, tp_size, tp_config)
    modules = dict(model.named_modules())
    for name, layer in plan.items():
        if layer.kind == COLUMN:
            _set_child(model, name, LinearLayer(modules[name], group, gather_output=layer.gather_output, name=name))
        elif layer.kind == ROW:
            _set_child(model, name, LinearAllreduce(modules[name], group, name=name))
    return summary(plan)


def broadcast_for_tensor_parallel(model: nn.Module, group: Any) -> None:
    """Every TP rank cuts its slice from the same whole model: TP rank 0's (one broadcast per dtype)."""
    from ..runtime.engine_setup import broadcast_module_states

    broadcast_module_states(model, group)


def tp_size_from_config(config: Any) -> int:
    """`tensor_parallel.autotp_size` of a raw config dict (or a path to one); 1 when absent or 0."""
    if config is None:
        return 1
    if not isinstance(config, dict):
        from ..runtime.config import load_config_dict

        config = load_config_dict(config)
    section = config.get("tensor_parallel") or {}
    size = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def tensor_parallel_section(config: Any) -> dict:
    if config is None:
        return {}
    if not isinstance(config, dict):
        from ..runtime.config import load_config_dict

        config = load_config_dict(config)
    section = config.get("tensor_parallel") or {}
    return dict(section) if isinstance(section, dict) else {}


def cast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    return model.to(dtype) if dtype is not None else model
