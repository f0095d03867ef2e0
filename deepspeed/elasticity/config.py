"""The `elasticity` section, checked once, and the errors of deepspeed.elasticity (upstream names).

The checks are upstream's (ElasticityConfig in DeepSpeed 0.19.7); each message names the key
(`elasticity.<key>`), the value given and what is allowed. Unknown keys in the section are an
error too (upstream ignores them, so a typo such as `micro_batch_size` went unnoticed).
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Mapping

from .constants import (
    ENABLED,
    ENABLED_DEFAULT,
    IGNORE_NON_ELASTIC_BATCH_INFO,
    IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT,
    MAX_ACCEPTABLE_BATCH_SIZE,
    MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT,
    MAX_GPUS,
    MAX_GPUS_DEFAULT,
    MICRO_BATCHES,
    MICRO_BATCHES_DEFAULT,
    MIN_GPUS,
    MIN_GPUS_DEFAULT,
    MIN_TIME,
    MIN_TIME_DEFAULT,
    MODEL_PARALLEL_SIZE,
    MODEL_PARALLEL_SIZE_DEFAULT,
    NUM_GPUS_PER_NODE,
    NUM_GPUS_PER_NODE_DEFAULT,
    PREFER_LARGER_BATCH,
    PREFER_LARGER_BATCH_DEFAULT,
    VERSION,
    VERSION_DEFAULT,
)

KNOWN_KEYS = (ENABLED, MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES, MIN_GPUS, MAX_GPUS, NUM_GPUS_PER_NODE,
              MODEL_PARALLEL_SIZE, MIN_TIME, PREFER_LARGER_BATCH, IGNORE_NON_ELASTIC_BATCH_INFO, VERSION)


class ElasticityError(Exception):
    """Base of the elasticity errors."""


class ElasticityConfigError(ElasticityError, ValueError):
    """An invalid or missing elasticity setting (also a ValueError)."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the GPU counts the elastic config supports."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(section: Mapping[str, Any], key: str, default: int, low: int) -> int:
    value = section.get(key, default)
    if not _is_int(value) or value < low:
        raise ElasticityConfigError(f"elasticity.{key}: got {value!r}; expected an integer >= {low}")
    return value


class ElasticityConfig:
    """The elasticity section's values under upstream's attribute names (max_acceptable_batch_size,
    micro_batches, min_gpus, max_gpus, model_parallel_size, num_gpus_per_node, min_time, version,
    prefer_larger_batch_size, ignore_non_elastic_batch_info)."""

    def __init__(self, param_dict: Mapping[str, Any]) -> None:
        if not isinstance(param_dict, Mapping):
            raise ElasticityConfigError(f"elasticity: got {param_dict!r}; expected an object of settings")
        unknown = [k for k in param_dict if k not in KNOWN_KEYS]
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), KNOWN_KEYS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f"; known keys: {', '.join(KNOWN_KEYS)}"
            raise ElasticityConfigError(f"elasticity.{unknown[0]}: unknown key{hint}")
        self.enabled = param_dict.get(ENABLED, ENABLED_DEFAULT)
        for key in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES):
            if self.enabled and key not in param_dict:
                raise ElasticityConfigError(f"elasticity.{key}: missing; an enabled elasticity section needs "
                                            f"{MAX_ACCEPTABLE_BATCH_SIZE} and {MICRO_BATCHES}")
        self.max_acceptable_batch_size = _int_at_least(param_dict, MAX_ACCEPTABLE_BATCH_SIZE,
                                                       MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT, 1)
        self.micro_batches = param_dict.get(MICRO_BATCHES, MICRO_BATCHES_DEFAULT)
        if not isinstance(self.micro_batches, list) or not self.micro_batches or not all(
                _is_int(m) and m > 0 for m in self.micro_batches):
            raise ElasticityConfigError(f"elasticity.{MICRO_BATCHES}: got {self.micro_batches!r}; expected a "
                                        "non-empty list of positive integers (per-GPU micro-batch sizes)")
        self.min_gpus = _int_at_least(param_dict, MIN_GPUS, MIN_GPUS_DEFAULT, 1)
        self.max_gpus = _int_at_least(param_dict, MAX_GPUS, MAX_GPUS_DEFAULT, 1)
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(f"elasticity.{MIN_GPUS} ({self.min_gpus}) is greater than "
                                        f"elasticity.{MAX_GPUS} ({self.max_gpus})")
        self.model_parallel_size = _int_at_least(param_dict, MODEL_PARALLEL_SIZE, MODEL_PARALLEL_SIZE_DEFAULT, 1)
        self.num_gpus_per_node = _int_at_least(param_dict, NUM_GPUS_PER_NODE, NUM_GPUS_PER_NODE_DEFAULT, 1)
        self.min_time = param_dict.get(MIN_TIME, MIN_TIME_DEFAULT)
        if isinstance(self.min_time, bool) or not isinstance(self.min_time, (int, float)) or self.min_time < 0:
            raise ElasticityConfigError(f"elasticity.{MIN_TIME}: got {self.min_time!r}; expected minutes >= 0")
        self.version = param_dict.get(VERSION, VERSION_DEFAULT)
        try:
            float(self.version)
        except (TypeError, ValueError):
            raise ElasticityConfigError(f"elasticity.{VERSION}: got {self.version!r}; expected 0.1 or 0.2") from None
        self.prefer_larger_batch_size = param_dict.get(PREFER_LARGER_BATCH, PREFER_LARGER_BATCH_DEFAULT)
        self.ignore_non_elastic_batch_info = param_dict.get(IGNORE_NON_ELASTIC_BATCH_INFO,
                                                            IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT)

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)
