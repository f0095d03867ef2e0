"""deepspeed.elasticity against DeepSpeed 0.19.7's results, and the engine config taking its batch from it.

tests/fixtures/launcher_0_19_8/elasticity.json holds compute_elastic_config's answer (or error)
for a grid of elasticity sections, world sizes and WORLD_SIZE values, recorded from upstream by
tools/launcher_fixtures.py (0.19.8 removed the package, so the fixtures come from 0.19.7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import deepspeed
from deepspeed.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)
from deepspeed.elasticity.elasticity import get_candidate_batch_sizes, get_valid_gpus
from deepspeed.runtime.config import DeepSpeedConfig

CASES = json.loads((Path(__file__).parents[1] / "fixtures" / "launcher_0_19_8" / "elasticity.json").read_text())
# upstream's exception type -> ours (we raise clearer, more specific types in two cases)
ERROR_TYPES = {
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityError": ElasticityError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
    "ValueError": ValueError,  # a micro batch above the maximum, a non-dict config (ElasticityConfigError is one)
    "NotImplementedError": ElasticityConfigError,  # an unknown version: named as a config error here
    "AssertionError": AssertionError,
}


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_compute_elastic_config_matches_upstream(case, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    if case["env_world_size"] is not None:
        monkeypatch.setenv("WORLD_SIZE", case["env_world_size"])
    call = lambda: compute_elastic_config(case["ds_config"], case["target_deepspeed_version"],  # noqa: E731
                                          world_size=case["world_size"], return_microbatch=case["return_microbatch"])
    if "error" in case:
        with pytest.raises(ERROR_TYPES[case["error"]["type"]]):
            call()
        return
    got = call()
    assert [got[0], got[1], *got[2:]] == case["result"]


def test_upstream_unit_examples():
    """The numbers upstream's own tests assert (tests/unit/elasticity/test_elastic.py)."""
    config = {"elasticity": {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                             "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}}
    batch, gpus = compute_elastic_config(config, deepspeed.__version__)
    assert (batch, len(gpus)) == (9792, 23)
    assert all(batch % g == 0 and any(batch // g % m == 0 for m in [8, 12, 16, 17]) for g in gpus)
    assert compute_elastic_config(config, deepspeed.__version__, world_size=64)[2] == 17
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 128 is not one of the GPU counts"):
        compute_elastic_config(config, deepspeed.__version__, world_size=128)


def test_search_helpers_are_exhaustive():
    """get_valid_gpus against a brute force over every GPU count; candidates never exceed the maximum."""
    for batch in (12, 96, 360, 1000, 9792):
        for micro in ([2, 4], [3, 7], [8, 12, 16, 17]):
            brute = [g for g in range(1, 200) if any(batch % (g * m) == 0 for m in micro)]
            assert get_valid_gpus(batch, micro, 1, 199) == brute
    assert all(c <= 1000 for c in get_candidate_batch_sizes([3, 7, 21, 2000], 1000))


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "micro_batch_sizes": [2]}, r"elasticity.max_train_batch_size: missing"),
    ({"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2, 0]},
     r"elasticity.micro_batch_sizes: got \[2, 0\]; expected a non-empty list of positive integers"),
    ({"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 4, "max_gpus": 2},
     r"elasticity.min_gpus \(4\) is greater than elasticity.max_gpus \(2\)"),
    ({"enabled": True, "max_train_batch_size": 8, "micro_batch_size": [2]}, r"elasticity.micro_batch_size: unknown "
     r"key \(did you mean 'micro_batch_sizes'\?\)"),
    ({"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "version": 0.7},
     r"elasticity.version: got 0.7; this runtime supports up to 0.2"),
])
def test_config_errors_name_key_value_and_allowed(section, message):
    with pytest.raises(ElasticityConfigError, match=message):
        compute_elastic_config({"elasticity": section}, deepspeed.__version__)


# --------------------------------------------------------------------------- the engine config

ELASTIC = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
           "version": 0.1}


@pytest.mark.parametrize("world, micro, gas", [(1, 4, 4), (2, 4, 2), (4, 4, 1)])
def test_config_takes_batch_from_elasticity(world, micro, gas, monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    config = DeepSpeedConfig({"elasticity": ELASTIC}, world_size=world)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        16, micro, gas)
    assert config.elasticity_enabled


def test_config_elastic_checks(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 3"):
        DeepSpeedConfig({"elasticity": ELASTIC}, world_size=3)
    with pytest.raises(ElasticityConfigError, match="train_batch_size: given while elasticity is enabled"):
        DeepSpeedConfig({"elasticity": ELASTIC, "train_batch_size": 8}, world_size=2)
    config = DeepSpeedConfig({"elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True},
                              "train_batch_size": 8}, world_size=2)
    assert config.train_batch_size == 16
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**ELASTIC, "max_train_batch_size": 32}))
    with pytest.raises(ElasticityConfigError, match=r"max_train_batch_size: the config says 16 but the resource "
                                                    r"scheduler planned with 32"):
        DeepSpeedConfig({"elasticity": ELASTIC}, world_size=2)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(ELASTIC))
    assert DeepSpeedConfig({"elasticity": ELASTIC}, world_size=2).train_batch_size == 16
    disabled = DeepSpeedConfig({"elasticity": {"enabled": False}, "train_batch_size": 4}, world_size=2)
    assert not disabled.elasticity_enabled and disabled.train_batch_size == 4
