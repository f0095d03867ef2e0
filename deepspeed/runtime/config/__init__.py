"""Typed DeepSpeed config (upstream path: deepspeed.runtime.config.DeepSpeedConfig).

    cfg = DeepSpeedConfig(config, mpu=None, world_size=None, strict=None)
    cfg.model.zero_optimization.stage, cfg.train_batch_size, cfg.raw, cfg.to_dict(), cfg.is_set("fp16.enabled")

See docs/config.md for what is validated and how errors read.
"""

from ..constants import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS,  # noqa: F401
                         LAMB_OPTIMIZER, LION_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUON_OPTIMIZER,
                         MUSGD_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER)
from .batch import BatchSizes, resolve_batch
from .ds_config import DeepSpeedConfig, data_parallel_world_size
from .errors import ConfigMismatchError, DeepSpeedConfigError
from .getters import *  # noqa: F401,F403  (upstream's get_<key>(param_dict) readers)
from .loader import load_config_dict
from .root import RootConfig

__all__ = [
    "BatchSizes",
    "ConfigMismatchError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "RootConfig",
    "data_parallel_world_size",
    "load_config_dict",
    "resolve_batch",
]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
