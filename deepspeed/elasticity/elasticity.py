"""compute_elastic_config: a global batch size compatible with many GPU counts.

[Note: elastic batch]
A global batch B works on N GPUs when B / N is a multiple of some allowed micro-batch size
(gradient accumulation makes up the rest). Version 0.1 scales each micro-batch size, and their
least common multiple, by the largest highly composite number that keeps the batch within
max_train_batch_size (highly composite numbers have the most divisors for their size), then
keeps the candidate with the most valid GPU counts in [min_gpus, max_gpus] (ties: the larger
batch, or the smaller one with prefer_larger_batch false). Version 0.2 does the same per node
(num_gpus_per_node, model_parallel_size) and, when the current world size is not among the
valid ones, falls back to the largest multiple of micro * data-parallel size within the maximum.
The arithmetic, including its float steps in version 0.2, follows DeepSpeed 0.19.7, and the
results equal upstream's on tests/fixtures/launcher_0_19_8/elasticity.json.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

from packaging import version as pkg_version

from ..utils.logging import logger
from ..version import __version__
from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import (
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    IGNORE_NON_ELASTIC_BATCH_INFO,
    LATEST_ELASTICITY_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
)

# The 38 smallest highly composite numbers: enough for batch sizes up to 720K.
HCN_LIST = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
            20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
            665280, 720720]
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def get_candidate_batch_sizes(base_list: Sequence[int], max_acceptable_batch_size: int) -> list[int]:
    """Each base scaled by the largest HCN keeping it <= the maximum (bases above it are dropped)."""
    candidates = set()
    for base in base_list:
        if base > max_acceptable_batch_size:
            continue
        if base == max_acceptable_batch_size:
            candidates.add(int(base))
            continue
        limit = max_acceptable_batch_size // base
        above = next((i for i, hcn in enumerate(HCN_LIST) if hcn > limit), 0)  # 0: none above -> the last HCN
        candidates.add(int(HCN_LIST[above - 1] * base))
    return sorted(candidates)


def _divisors_in(n: int, low: int, high: int) -> set[int]:
    found = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            found.update(x for x in (d, n // d) if low <= x <= high)
    return found


def get_valid_gpus(batch_size: int, micro_batches: Sequence[int], min_valid_gpus: int, max_valid_gpus: int) -> list[int]:
    """GPU counts in [min, max] for which batch_size / count is a multiple of some micro batch."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        most = batch_size // micro
        if min_valid_gpus <= most <= max_valid_gpus:
            valid.add(most)
        valid |= _divisors_in(most, min_valid_gpus, min(max_valid_gpus, most // 2))
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes: Sequence[int], micro_batches: Sequence[int], min_gpus: int,
                        max_gpus: int, prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate with the most valid GPU counts; ties go to the larger (or smaller) batch.

    The starting point is (no GPU counts, the smallest micro batch), so a candidate with no valid
    count wins only by being larger (or smaller) than that micro batch."""
    best_count, best_gpus, best_batch = 0, None, int(min(micro_batches))
    for batch in candidate_batch_sizes:
        gpus = get_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        better_size = batch > best_batch if prefer_larger else batch < best_batch
        if len(gpus) > best_count or (len(gpus) == best_count and better_size):
            best_count, best_gpus, best_batch = len(gpus), gpus, batch
    return best_batch, best_gpus


def _get_compatible_gpus_v01(micro_batches: Sequence[int], max_acceptable_batch_size: int, min_gpus: int | None = None,
                             max_gpus: int | None = None, prefer_larger: bool = True) -> tuple[int, list[int] | None]:
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_acceptable_batch_size]
    if too_big:
        raise ElasticityConfigError(f"elasticity.micro_batch_sizes: {too_big[0]} is larger than "
                                    f"elasticity.max_train_batch_size ({max_acceptable_batch_size}); every micro "
                                    "batch must fit in the global batch")
    bases = list(micro_batches) + [math.lcm(*micro_batches)]
    candidates = get_candidate_batch_sizes(bases, max_acceptable_batch_size)
    logger.info(f"Candidate batch size: {candidates}")
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _pick_micro(batch: float, divisor: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
    """Version 0.2's micro batch: the first (or, preferring larger, the largest) dividing batch // divisor."""
    chosen = None
    for micro in micro_batches:
        if batch // divisor % micro == 0:
            if chosen is None or (prefer_larger and chosen < micro):
                chosen = micro
    return chosen


def _get_compatible_gpus_v02(micro_batches: Sequence[int], max_acceptable_batch_size: int, current_num_gpus: int,
                             min_gpus: int | None = None, max_gpus: int | None = None, prefer_larger: bool = True,
                             num_gpus_per_node: int = 1, model_parallel_size: int = 1):
    """(batch, valid data-parallel sizes, micro batch) at node granularity; see [Note: elastic batch]."""
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"elasticity (version 0.2): num_gpus_per_node ({num_gpus_per_node}) must be divisible "
                              f"by model_parallel_size ({model_parallel_size})")
    dp_per_node = num_gpus_per_node // model_parallel_size
    batch, valid_nodes = _get_compatible_gpus_v01(micro_batches, int(max_acceptable_batch_size / dp_per_node),
                                                  int(min_gpus / num_gpus_per_node),
                                                  int(max_gpus / num_gpus_per_node), prefer_larger=prefer_larger)
    batch = int(batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in (valid_nodes or [])]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, _pick_micro(batch, current_num_gpus, micro_batches, prefer_larger)
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    fits = [math.floor(max_acceptable_batch_size / float(m * current_dp)) * m * current_dp for m in micro_batches]
    fallback = max(fits) if prefer_larger else min(fits)
    return fallback, [int(current_dp)], _pick_micro(fallback, current_num_gpus, micro_batches, prefer_larger)


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    if pkg_version.parse(target_deepspeed_version) < pkg_version.parse(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"target DeepSpeed version {target_deepspeed_version} is older than "
                              f"{MINIMUM_DEEPSPEED_VERSION}, the first with elasticity")
    return True


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    if ELASTICITY not in ds_config or not isinstance(ds_config[ELASTICITY], Mapping):
        return False
    return bool(ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """The scheduler's elasticity section ($DEEPSPEED_ELASTICITY_CONFIG, JSON) must match the runtime's."""
    if DEEPSPEED_ELASTICITY_CONFIG not in os.environ:
        logger.warning(f"{DEEPSPEED_ELASTICITY_CONFIG} is not set: cannot check that the resource scheduler "
                       "scales this job to GPU counts its elastic config supports")
        return
    scheduler = ElasticityConfig(json.loads(os.environ[DEEPSPEED_ELASTICITY_CONFIG]))
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    for attr, key in (("max_acceptable_batch_size", "max_train_batch_size"), ("micro_batches", "micro_batch_sizes"),
                      ("version", "version")):
        if getattr(runtime, attr) != getattr(scheduler, attr):
            raise ElasticityConfigError(f"elasticity.{key}: the config says {getattr(runtime, attr)!r} but the "
                                        f"resource scheduler planned with {getattr(scheduler, attr)!r} "
                                        f"(${DEEPSPEED_ELASTICITY_CONFIG}); they must agree")


def _world_size_from_env(version: Any, purpose: str) -> int:
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or not raw.isnumeric():
        raise ElasticityConfigError(f"elasticity version {version} needs the world size to compute {purpose}: pass "
                                    f"world_size to compute_elastic_config or set WORLD_SIZE (it is {raw!r})")
    return int(raw)


def _largest_micro(final_batch_size: int, world_size: int, micro_batches: Sequence[int]) -> int:
    for micro in sorted(set(micro_batches), reverse=True):
        if final_batch_size // world_size % micro == 0:
            return micro
    raise AssertionError(f"no micro batch in {list(micro_batches)} divides {final_batch_size} // {world_size}")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
    """(train_batch_size, valid GPU counts[, micro batch size]) for the config's elasticity section.

    The same `ds_config` always gives the same answer, so schedulers and the runtime agree. With
    world_size > 0 (or return_microbatch, taking WORLD_SIZE from the environment) the world size
    must be one of the valid counts, and the micro batch is returned too. See [Note: elastic batch].
    Raises ElasticityConfigError for a missing/disabled/invalid section, ElasticityError for an
    old target version, ElasticityIncompatibleWorldSize for a world size outside the valid counts.
    """
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config: expected a dict, got {type(ds_config).__name__}: {ds_config!r}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from the config; add the section to run an elastic job")
    section = ds_config[ELASTICITY]
    if not isinstance(section, Mapping) or not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError(f"{ELASTICITY}.{ENABLED}: the section is disabled; set \"enabled\": true to run "
                                    "an elastic job")
    config = ElasticityConfig(section)
    version = float(config.version)
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.model_parallel_size: {config.model_parallel_size} needs "
                                    f"elasticity.version 0.2 (got {config.version})")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity.version: got {config.version}; this runtime supports up to "
                                    f"{LATEST_ELASTICITY_VERSION}")
    _compatible_ds_version_check(target_deepspeed_version)
    micro_candidate = None
    if version == 0.1:
        final_batch_size, valid_gpus = _get_compatible_gpus_v01(config.micro_batches, config.max_acceptable_batch_size,
                                                                config.min_gpus, config.max_gpus,
                                                                config.prefer_larger_batch_size)
    elif version == 0.2:
        current = world_size if world_size != 0 else _world_size_from_env(config.version, "a valid batch size")
        final_batch_size, valid_gpus, micro_candidate = _get_compatible_gpus_v02(
            config.micro_batches, config.max_acceptable_batch_size, current, config.min_gpus, config.max_gpus,
            config.prefer_larger_batch_size, config.num_gpus_per_node, config.model_parallel_size)
    else:
        raise ElasticityConfigError(f"elasticity.version: got {config.version}; expected 0.1 or 0.2")
    final_batch_size = int(final_batch_size)
    logger.info(f"Valid World Size (GPUs / Model Parallel Size): {valid_gpus}")
    if world_size <= 0 and return_microbatch and version == 0.2:
        return final_batch_size, valid_gpus, micro_candidate
    if world_size <= 0 and return_microbatch:
        world_size = _world_size_from_env(config.version, "a micro batch size")
    if world_size > 0:
        if world_size not in (valid_gpus or []):
            raise ElasticityIncompatibleWorldSize(f"world size {world_size} is not one of the GPU counts this "
                                                  f"elastic config supports: {valid_gpus}")
        return final_batch_size, valid_gpus, _largest_micro(final_batch_size, world_size, config.micro_batches)
    return final_batch_size, valid_gpus


def elastic_batch_params(ds_config: Mapping[str, Any], world_size: int) -> dict[str, int] | None:
    """The batch triple the engine uses when the config enables elasticity (None otherwise).

    Raises ElasticityConfigError when the config also gives batch sizes, unless the section sets
    ignore_non_elastic_batch_info (then they are overridden, with a warning), as upstream."""
    if not elasticity_enabled(ds_config):
        return None
    section = ds_config[ELASTICITY]
    final_batch_size, valid_gpus, micro = compute_elastic_config(dict(ds_config), __version__, world_size=world_size)
    ensure_immutable_elastic_config(section)
    given = [k for k in BATCH_KEYS if k in ds_config]
    if given and not section.get(IGNORE_NON_ELASTIC_BATCH_INFO, False):
        raise ElasticityConfigError(f"{', '.join(given)}: given while elasticity is enabled, which sets the batch "
                                    f"sizes itself; remove them, or set elasticity.{IGNORE_NON_ELASTIC_BATCH_INFO}: "
                                    "true to have them ignored")
    params = {"train_batch_size": final_batch_size, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": final_batch_size // (micro * world_size)}
    for key in given:
        logger.warning(f"[Elasticity] overriding {key}: {ds_config[key]} -> {params[key]}")
    logger.info(f"[Elasticity] valid GPU counts: {valid_gpus}; batch {params}")
    return params
