"""AutoEP's plan and config section, without processes: which blocks are MoE blocks, which experts each EP
rank keeps, and the errors for what does not fit ([Note: the AutoEP plan])."""

from __future__ import annotations

import os
import sys

import pytest

from deepspeed.module_inject.auto_ep_plan import build_plan, owned_experts, resolve_preset
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
from autoep_jobs import build  # noqa: E402


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_plan_finds_every_block(kind: str) -> None:
    model = build(kind)
    for section in ({"preset_model": kind}, {}):   # named, or chosen from config.model_type
        plans = build_plan(model, section, 2)
        assert [p.name for p in plans] == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert [p.experts_name for p in plans] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert all(p.num_experts == 4 and p.num_local_experts == 2 and (p.w1, p.w2) == ("gate_up_proj", "down_proj")
                   for p in plans)
    assert resolve_preset(model, {})[0] == kind


def test_owned_experts_partition_contiguously() -> None:
    for experts, ep in ((8, 1), (8, 2), (8, 4), (6, 3)):
        ranges = [owned_experts(experts, ep, r) for r in range(ep)]
        assert [e for r in ranges for e in r] == list(range(experts))
        assert all(len(r) == experts // ep for r in ranges)


def test_plan_errors_name_what_is_wrong() -> None:
    model = build("mixtral")
    with pytest.raises(ValueError, match=r"autoep_size=3: model.layers.0.mlp has 4 experts.*\[1, 2, 4\]"):
        build_plan(model, {}, 3)
    with pytest.raises(ValueError, match=r"preset_model='qwen3_moe' is for model_type.*'mixtral'"):
        build_plan(model, {"preset_model": "qwen3_moe"}, 2)
    with pytest.raises(ValueError, match=r"no MoE block matched moe_layer_pattern='model\\\\.nothing'"):
        build_plan(model, {"moe_layer_pattern": r"model\.nothing"}, 2)
    with pytest.raises(ValueError, match=r"no fused 3-D expert parameters 'w1'"):
        build_plan(model, {"expert_w1": "w1"}, 2)
    with pytest.raises(ValueError, match=r"route_norm=False: model.layers.0.mlp's router does normalise"):
        build_plan(model, {"route_norm": False}, 2)
    assert len(build_plan(build("qwen3_moe"), {"route_norm": False}, 2)) == 2   # the tiny Qwen3 has norm_topk_prob off
    model.config.model_type = "llama"
    with pytest.raises(ValueError, match=r"no preset for model_type 'llama'; set preset_model"):
        build_plan(model, {}, 2)
    plans = build_plan(model, {"moe_layer_pattern": r"model\.layers\.\d+\.mlp"}, 4)   # custom: patterns alone
    assert [p.num_local_experts for p in plans] == [1, 1]


def test_config_section_accepts_upstream_keys() -> None:
    section = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "moe_layer_pattern": r"model\.layers\.\d+\.mlp",
               "expert_pattern": "experts", "router_pattern": "gate", "use_grouped_mm": False, "combine_impl": "auto",
               "score_apply": "post", "score_func": "auto", "top_k": "auto", "route_scale": 1.0,
               "routed_scaling_factor": "auto", "load_balance_coeff": None, "expert_tensor_parallel_size": 1,
               "has_shared_experts": False, "validate_folding_routing": False}
    config = DeepSpeedConfig({"train_batch_size": 8, "expert_parallel": section}, world_size=2)
    assert config.model.expert_parallel.autoep_size == 2 and config.model.expert_parallel.enabled


@pytest.mark.parametrize("key,value,says", [
    ("preset_model", "gpt_oss", "unknown preset 'gpt_oss'; known: ['deepseek_v2'"),
    ("top_k", 4, "overriding the model's routing (top_k=4)"),
    ("score_func", "sigmoid", "overriding the model's routing (score_func='sigmoid')"),
    ("score_apply", "pre", "only 'auto' or 'post'"),
    ("expert_w3", "w3", "separate (unfused) expert up projections"),
    ("load_balance_coeff", 0.01, "load_balance_coeff=0.01"),
    ("expert_pattern", "mlp.experts", "direct attribute name (no dots), got 'mlp.experts'"),
    ("autoep_size", 0, "got 0; expected a value >= 1"),
    ("moe_layer_pattern", "model.(", "not a regular expression"),
])
def test_config_section_refusals(key: str, value, says: str) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({"train_batch_size": 8, "expert_parallel": {"enabled": True, key: value}}, world_size=1)
    text = str(info.value)
    assert f"expert_parallel.{key}" in text and says in text, text


def test_plan_refuses_a_block_that_does_not_call_its_experts() -> None:
    """A block that indexes its experts' fused parameters itself (upstream's mock) would read local experts
    under global ids after the swap: refused, naming the module."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))
            self.down_proj = nn.Parameter(torch.zeros(4, 4, 4))

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = nn.Module()
    model.model.layers[0].mlp.gate = nn.Linear(4, 4)
    model.model.layers[0].mlp.experts = Experts()
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Experts\) has no forward\(hidden_states"):
        build_plan(model, {"moe_layer_pattern": r"model\.layers\.\d+\.mlp"}, 2)
