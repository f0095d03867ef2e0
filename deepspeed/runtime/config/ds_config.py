"""DeepSpeedConfig: load, validate and resolve a config once, before any collective runs."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

from deepspeed.elasticity.elasticity import elastic_batch_params
from deepspeed.utils.logging import logger

from .batch import BatchSizes, resolve_batch
from .errors import BatchConfigError, DeepSpeedConfigError
from .loader import load_config_dict
from .root import BATCH_KEYS, RootConfig, log_auto_defaults, prepare, validate
from .sections.base import TORCH_DTYPES, field_keys, submodel

STRICT_ENV = "DS_STRICT_CONFIG"


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def data_parallel_world_size(mpu: Any = None, world_size: Optional[int] = None, mesh_device: Any = None) -> int:
    """The data-parallel size for batch arithmetic: argument, mpu, device mesh, torch.distributed,
    WORLD_SIZE, 1. Only reads sizes; never runs a collective (validation comes first, on every rank).
    """
    if world_size is not None:
        return world_size
    if mpu is not None:
        if not hasattr(mpu, "get_data_parallel_world_size"):
            raise DeepSpeedConfigError("mpu must provide get_data_parallel_world_size()")
        return int(mpu.get_data_parallel_world_size())
    if mesh_device is not None:  # upstream's mesh_device argument: a DeviceMesh with a "data_parallel" dim
        return int(mesh_device["data_parallel"].size())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    env = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(env)
    except ValueError:
        raise DeepSpeedConfigError(f"environment variable WORLD_SIZE must be an integer, got {env!r}") from None


def _opt(section: str, attr: str) -> Callable[["DeepSpeedConfig"], Any]:
    return lambda c: None if getattr(c.model, section) is None else getattr(getattr(c.model, section), attr)


# Upstream DeepSpeedConfig attribute names that code written against upstream still reads.
_COMPAT: dict[str, Callable[["DeepSpeedConfig"], Any]] = {
    "_param_dict": lambda c: c.raw,
    "zero_config": lambda c: c.model.zero_optimization,
    "zero_optimization_stage": lambda c: c.model.zero_optimization.stage,
    "zero_enabled": lambda c: c.model.zero_optimization.stage > 0,
    "float16_config": lambda c: c.model.fp16,
    "bfloat16_config": lambda c: c.model.bf16,
    "fp16_enabled": lambda c: c.model.fp16.enabled,
    "bfloat16_enabled": lambda c: c.model.bf16.enabled,
    "optimizer_name": _opt("optimizer", "name"),
    "optimizer_params": _opt("optimizer", "params"),
    "scheduler_name": _opt("scheduler", "type"),
    "scheduler_params": _opt("scheduler", "params"),
    "communication_data_type": lambda c: c.communication_dtype,
    "activation_checkpointing_config": lambda c: c.model.activation_checkpointing,
    "checkpoint_config": lambda c: c.model.checkpoint,
    "checkpoint_tag_validation_enabled": lambda c: c.model.checkpoint.tag_validation_enabled,
    "checkpoint_tag_validation_fail": lambda c: c.model.checkpoint.tag_validation_fail,
    "load_universal_checkpoint": lambda c: c.model.checkpoint.load_universal,
    "use_node_local_storage": lambda c: c.model.checkpoint.use_node_local_storage,
    "grad_accum_dtype": lambda c: c.model.data_types.grad_accum_dtype,
    "param_dtype": lambda c: c.model.data_types.param_dtype,
    "buffer_dtype": lambda c: c.model.data_types.buffer_dtype,
    "torch_autocast_enabled": lambda c: c.model.torch_autocast.enabled,
    "torch_autocast_dtype": lambda c: c.model.torch_autocast.dtype,
    "torch_autocast_lower_precision_safe_modules": lambda c: c.model.torch_autocast.lower_precision_safe_modules,
    "elasticity_enabled": lambda c: c._elastic is not None,
    "monitor_config": lambda c: _monitor_config(c.model),
    "flops_profiler_config": lambda c: c.model.flops_profiler,
    "timers_config": lambda c: c.model.timers.throughput,
    "expert_parallel_config": lambda c: _autoep_config(c.raw),
}


def _autoep_config(raw: dict) -> Any:
    """The `expert_parallel` section as DeepSpeed's AutoEPConfig (validated by the section model already)."""
    from ...module_inject.auto_ep_config import parse_autoep_config

    return parse_autoep_config(raw.get("expert_parallel"))


def _monitor_config(model: Any) -> Any:
    from ...monitor.monitor import monitor_config_of

    return monitor_config_of(model)
_SAME_NAME = ("gradient_clipping", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
              "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "dataloader_drop_last",
              "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "managed_gradient_accumulation",
              "disable_allgather", "pipeline", "log_level")


class DeepSpeedConfig:
    """A validated config: `model` (RootConfig), resolved batch sizes, and the user's dict.

    Raises DeepSpeedConfigError listing every problem found (one line each).
    """

    raw: dict[str, Any]          # the user's dict as loaded; never mutated
    model: RootConfig            # typed view, defaults filled, batch sizes resolved
    world_size: int              # data-parallel world size used for the batch arithmetic
    auto_keys: tuple[str, ...]   # dotted paths whose "auto" value was dropped for the default

    def __init__(self, config: Any, mpu: Any = None, world_size: Optional[int] = None,
                 strict: Optional[bool] = None, mesh_device: Any = None):
        self.raw = load_config_dict(config)
        self._elastic: Optional[dict[str, int]] = None  # batch triple from the elasticity section
        self.strict = strict_from_env() if strict is None else bool(strict)
        prepared = prepare(self.raw, self.strict)
        model = validate(prepared)
        errors = prepared.errors
        try:
            self.world_size = data_parallel_world_size(mpu, world_size, mesh_device)
            # ElasticityError (not a DeepSpeedConfigError) propagates as upstream raises it.
            self._elastic = elastic_batch_params(self.raw, self.world_size)
            batch = self._resolve_batch(model, prepared.data)
        except DeepSpeedConfigError as exc:
            errors.extend(line for line in exc.errors if line not in errors)
            batch = None
        if errors or model is None or batch is None:
            raise DeepSpeedConfigError(errors)
        for key in BATCH_KEYS:
            model.__dict__[key] = getattr(batch, key)  # already checked; skip re-validating the root
        self.model = model
        self._user = prepared.data
        self.auto_keys = tuple(prepared.auto_paths)
        log_auto_defaults(model, prepared.auto_paths)

    def _resolve_batch(self, model: Optional[RootConfig], data: dict[str, Any]) -> Optional[BatchSizes]:
        if self._elastic is not None:  # the elasticity section sets all three (deepspeed/elasticity)
            return resolve_batch(*(self._elastic[k] for k in BATCH_KEYS), self.world_size)
        values = [getattr(model, k) if model is not None else data.get(k) for k in BATCH_KEYS]
        if model is None and not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
            return None  # the type errors are already reported
        if any(isinstance(self.raw.get(k), str) and self.raw[k] == "auto" for k in BATCH_KEYS):
            return None  # reported by prepare(); the arithmetic would only add noise
        return resolve_batch(*values, self.world_size)

    # -------------------------------------------------------------------------- accessors
    # Upstream lets code assign the three batch members and then call _configure_train_batch_size()
    # (its tests and some launch scripts do); an assignment only records the value (None: unset).
    @property
    def train_batch_size(self) -> Optional[int]:
        return self.model.train_batch_size

    @train_batch_size.setter
    def train_batch_size(self, value: Optional[int]) -> None:
        self.model.__dict__["train_batch_size"] = value

    @property
    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self.model.train_micro_batch_size_per_gpu

    @train_micro_batch_size_per_gpu.setter
    def train_micro_batch_size_per_gpu(self, value: Optional[int]) -> None:
        self.model.__dict__["train_micro_batch_size_per_gpu"] = value

    @property
    def gradient_accumulation_steps(self) -> Optional[int]:
        return self.model.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: Optional[int]) -> None:
        self.model.__dict__["gradient_accumulation_steps"] = value

    def _configure_train_batch_size(self) -> None:
        """Resolve the batch triple from the members as they are now (upstream's name); an
        inconsistent or incomplete triple raises BatchConfigError (also an AssertionError, as upstream)."""
        try:
            batch = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                  self.gradient_accumulation_steps, self.world_size)
        except DeepSpeedConfigError as exc:
            raise BatchConfigError(exc.errors) from None
        for key in BATCH_KEYS:
            self.model.__dict__[key] = getattr(batch, key)

    def set_batch(self, train_batch_size: int, gradient_accumulation_steps: int,
                  micro_batch_size: Optional[int] = None) -> None:
        """Re-resolve the batch triple at run time (engine.set_train_batch_size and friends)."""
        micro = micro_batch_size or self.train_micro_batch_size_per_gpu
        batch = resolve_batch(train_batch_size, micro, gradient_accumulation_steps, self.world_size)
        for key in BATCH_KEYS:
            self.model.__dict__[key] = getattr(batch, key)

    @property
    def communication_dtype(self) -> Optional[torch.dtype]:
        name = self.model.communication_data_type
        if name is None and self.model.sequence_parallel_size > 1 and self.is_set("seq_parallel_communication_data_type"):
            name = self.model.seq_parallel_communication_data_type   # upstream: the gradient dtype under SP
        return None if name is None else TORCH_DTYPES[name]

    def __getattr__(self, name: str) -> Any:
        if name in _COMPAT:
            return _COMPAT[name](self)
        if name in _SAME_NAME:
            return getattr(self.model, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def is_set(self, path: str) -> bool:
        """True iff the user wrote the dotted key (an alias counts; defaults and "auto" do not)."""
        node: Any = self._user
        model = RootConfig
        for part in path.split("."):
            if not isinstance(node, dict):
                return False
            keys = field_keys(model) if model is not None else {}
            name = keys.get(part)
            spellings = {part} | ({k for k, n in keys.items() if n == name} if name else set())
            hit = next((s for s in spellings if s in node), None)
            if hit is None:
                return False
            node, model = node[hit], submodel(model, hit) if model is not None else None
        return True

    def to_dict(self) -> dict[str, Any]:
        """Every resolved value (defaults filled, batch sizes resolved) as plain JSON types."""
        return self.model.model_dump(mode="json", by_alias=True)

    def print_config(self, name: str = "DeepSpeedConfig") -> None:
        logger.info(f"{name} (data-parallel world size {self.world_size}):\n"
                    + json.dumps(self.to_dict(), indent=2, sort_keys=True))

    print = print_config  # upstream spelling: config.print(name)

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, "
                f"micro={self.train_micro_batch_size_per_gpu}, gas={self.gradient_accumulation_steps}, "
                f"world_size={self.world_size}, zero_stage={self.model.zero_optimization.stage})")
