"""The pure half of the cross-rank config agreement (deepspeed/runtime/config/agreement.py): views,
digests, the diff of two resolved configs with dotted key names, and the message lines."""

from __future__ import annotations

import pytest

from deepspeed.runtime.agreement import resolved_config
from deepspeed.runtime.config import ConfigMismatchError, DeepSpeedConfig
from deepspeed.runtime.config.agreement import (ABSENT, PER_RANK_KEYS, agreement_view, canonical, describe,
                                                differences, diff_configs, digest)


def test_diff_names_nested_keys_with_dots():
    a = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
         "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999]}}}
    b = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "none"}},
         "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.99]}}}
    assert diff_configs(a, b) == [("train_micro_batch_size_per_gpu", 4, 8),
                                  ("zero_optimization.offload_param.device", "cpu", "none"),
                                  ("optimizer.params.betas", [0.9, 0.999], [0.9, 0.99])]
    assert diff_configs(a, a) == []


def test_diff_absent_keys_and_a_section_against_null():
    assert diff_configs({"a": {"x": 1}}, {"a": {"x": 1, "y": 2}, "b": 3}) == [("a.y", ABSENT, 2), ("b", ABSENT, 3)]
    assert diff_configs({"optimizer": None}, {"optimizer": {"type": "Adam"}}) == \
        [("optimizer", None, {"type": "Adam"})]


def test_diff_numbers_by_value_but_not_bools():
    assert diff_configs({"lr": 1}, {"lr": 1.0}) == []
    assert diff_configs({"flag": True}, {"flag": 1}) == [("flag", True, 1)]
    assert diff_configs({"x": "1"}, {"x": 1}) == [("x", "1", 1)]


def test_canonical_and_digest_ignore_spelling_only():
    assert canonical({"a": (1.0, 2.5), "b": {"c": 3.0}}) == {"a": [1, 2.5], "b": {"c": 3}}
    one = {"x": 1, "y": {"z": [1, 2], "w": None}}
    assert digest(agreement_view(one)) == digest(agreement_view({"y": {"w": None, "z": [1.0, 2]}, "x": 1.0}))
    assert digest(agreement_view(one)) != digest(agreement_view({"x": 2, "y": {"z": [1, 2], "w": None}}))
    assert 0 <= digest(one) < 2**62   # an int64 and its negation


def test_view_drops_only_the_per_rank_keys():
    offload = {"device": "cpu", "nvme_path": "/local/nvme"}
    resolved = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "tensorboard": {"output_path": "/n0"},
                                "comet": {"api_key": "secret"}, "zero_optimization": {
                                    "stage": 3, "offload_param": offload, "offload_optimizer": offload}},
                               world_size=1).to_dict()
    for key in PER_RANK_KEYS:   # each names a real resolved key (a typo would silently drop nothing)
        node = resolved
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]
    view = agreement_view(resolved)
    assert "output_path" not in view["tensorboard"] and view["tensorboard"]["enabled"] is False
    assert "api_key" not in view["comet"] and "aio" not in view
    assert "nvme_path" not in view["zero_optimization"]["offload_param"]
    assert view["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert view["train_micro_batch_size_per_gpu"] == 2
    assert resolved["tensorboard"]["output_path"] == "/n0"   # the config itself is left alone


def _digest(config: dict, world_size: int = 2) -> int:
    return digest(agreement_view(resolved_config(DeepSpeedConfig(config, world_size=world_size))))


@pytest.mark.parametrize("a, b", [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4},
     {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto", "fp16": {"enabled": "auto"}},
     {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "fp16": {"enabled": False}}),
    ({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}},
     {"optimizer": {"params": {"lr": 0.001}, "type": "AdamW"}, "train_micro_batch_size_per_gpu": 4}),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10}},
     {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 10.0}}),
], ids=["batch_derived", "auto", "optimizer_name_and_order", "alias_and_float"])
def test_equivalent_configs_have_one_digest(a, b):
    assert _digest(a) == _digest(b)


@pytest.mark.parametrize("b", [
    {"train_micro_batch_size_per_gpu": 8},
    {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}},
    {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}},
])
def test_different_configs_have_different_digests(b):
    assert _digest({"train_micro_batch_size_per_gpu": 4}) != _digest(b)


def test_differences_and_message_lines_group_ranks():
    views = {0: {"m": 4, "z": {"stage": 2}}, 1: {"m": 8, "z": {"stage": 2}},
             2: {"m": 4, "z": {"stage": 3}}, 3: {"m": 4, "z": {"stage": 2}}}
    diff = differences(views)
    assert diff == {"m": {0: 4, 1: 8, 2: 4, 3: 4}, "z.stage": {0: 2, 1: 2, 2: 3, 3: 2}}
    assert describe(diff) == ["m: ranks 0, 2-3 = 4, rank 1 = 8", "z.stage: ranks 0-1, 3 = 2, rank 2 = 3"]
    assert describe(differences({0: {"o": {"type": "Adam"}}, 1: {}})) == \
        ['o: rank 0 = {"type": "Adam"}, rank 1 = (absent)']
    assert describe(differences({0: {"s": "a" * 200}, 1: {"s": "b"}}))[0].endswith('rank 1 = "b"')
    many = describe(differences({0: {f"k{i}": 0 for i in range(25)}, 1: {f"k{i}": 1 for i in range(25)}}))
    assert len(many) == 21 and many[-1] == "... and 5 more keys"


def test_mismatch_error_reads_and_is_a_config_error():
    diff = {"train_micro_batch_size_per_gpu": {0: 4, 1: 8}}
    error = ConfigMismatchError("deepspeed.initialize", describe(diff), diff)
    assert isinstance(error, ValueError) and isinstance(error, AssertionError)
    assert str(error).startswith("deepspeed.initialize: the ranks were started with different DeepSpeed configs")
    assert "\n  train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8\n" in str(error)
    assert error.differences == diff and error.errors == ["train_micro_batch_size_per_gpu: rank 0 = 4, rank 1 = 8"]
