# compat: the public `deepspeed` namespace. Names resolve lazily so that `import deepspeed`
# stays cheap (no pydantic, no engine) until a script actually uses them.
"""A pure-Python reimplementation of the DeepSpeed training runtime on PyTorch."""

from __future__ import annotations

import importlib
from typing import Any

from ._lazy import import_submodule
from .version import __version__, git_branch, git_hash, version

__git_hash__, __git_branch__ = git_hash, git_branch   # upstream's names (None: not built from a git checkout)

__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("+")[0].split(".")[:3])

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "initialize": ("deepspeed.runtime.builder", "initialize"),
    "add_config_arguments": ("deepspeed.runtime.builder", "add_config_arguments"),
    "default_inference_config": ("deepspeed.runtime.builder", "default_inference_config"),
    "init_distributed": ("deepspeed.comm.comm", "init_distributed"),
    "DeepSpeedEngine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedConfig": ("deepspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("deepspeed.runtime.config", "DeepSpeedConfigError"),
    "DeepSpeedDataLoader": ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    "DeepSpeedOptimizer": ("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer"),
    "get_accelerator": ("deepspeed.accelerator", "get_accelerator"),
    "logger": ("deepspeed.utils.logging", "logger"),
    "log_dist": ("deepspeed.utils.logging", "log_dist"),
    "comm": ("deepspeed.comm", None),
    "accelerator": ("deepspeed.accelerator", None),
    "ops": ("deepspeed.ops", None),
    "runtime": ("deepspeed.runtime", None),
    "zero": ("deepspeed.runtime.zero", None),
    "utils": ("deepspeed.utils", None),
    "launcher": ("deepspeed.launcher", None),
    "config": ("deepspeed.config", None),
    "checkpoint": ("deepspeed.checkpoint", None),
    "tp_model_init": ("deepspeed.runtime.builder", "tp_model_init"),
    "set_optimizer_flags": ("deepspeed.runtime.builder", "set_optimizer_flags"),
    "resolve_per_head_muon_after_sharding": ("deepspeed.runtime.zero.muon.per_head",
                                             "resolve_per_head_muon_after_sharding"),
    "_attention_head_count": ("deepspeed.runtime.zero.muon.per_head", "_attention_head_count"),   # upstream's
    "_confirm": ("deepspeed.runtime.zero.muon.per_head", "_confirm"),   # helpers, imported by its tests
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "checkpointing": ("deepspeed.runtime.activation_checkpointing.checkpointing", None),
    "DeepSpeedTransformerConfig": ("deepspeed.ops.transformer", "DeepSpeedTransformerConfig"),
    "DeepSpeedTransformerLayer": ("deepspeed.ops.transformer", "DeepSpeedTransformerLayer"),
}

__all__ = ["__version__", "version", *(n for n in _LAZY if not n.startswith("_"))]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        return import_submodule(__name__, name)   # any other submodule: deepspeed.env_report, ...
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
