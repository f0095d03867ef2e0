"""The AutoTP sharding plan ([Note: the AutoTP plan] in deepspeed/module_inject/tp_plan.py): pure, no processes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from deepspeed.module_inject.tp_plan import COLUMN, ROW, SKIP, build_plan, hf_tp_plan, summary
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def _llama(heads: int = 4, kv: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                                        intermediate_size=128, num_hidden_layers=2, vocab_size=32))


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))


class _Net(nn.Module):
    def __init__(self, mid: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.attn = _Attn()
        self.mlp = nn.Sequential(nn.Linear(8, mid), nn.GELU(), nn.Linear(mid, 8))
        self.proj = nn.Linear(8, 8)   # alone in its parent (the root also holds lm_head): whole
        self.lm_head = nn.Linear(8, 10)


def test_hf_tp_plan_of_llama_wins_over_the_automatic_rule():
    model = _llama()
    plan = hf_tp_plan(model)
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise" and plan["lm_head"] == "colwise_gather_output"
    built = build_plan(model, 2)
    got = summary(built)
    assert got[ROW] == [f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.o_proj", "mlp.down_proj")]
    assert len(got[COLUMN]) == 11 and got[SKIP] == []
    assert built["lm_head"].gather_output and built["lm_head"].source == "tp_plan"


def test_automatic_rule_names_then_last_linear():
    plan = summary(build_plan(_Net(), 2))
    assert plan[ROW] == ["attn.o_proj", "mlp.2"]
    assert plan[COLUMN] == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.0"]
    assert plan[SKIP] == ["proj", "lm_head"]


def test_layer_specs_first_then_replicated():
    config = {"partition_config": {"layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"}]}}
    plan = summary(build_plan(_llama(), 2, config))
    assert plan[ROW] == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert len(plan[COLUMN]) == 6 and "lm_head" in plan[SKIP] and "model.layers.0.mlp.down_proj" in plan[SKIP]


def test_model_types_and_preset():
    spec = {"patterns": [r".*o_proj\.weight$"], "partition_type": "row", "model_types": ["gpt2"]}
    plan = summary(build_plan(_llama(), 2, {"partition_config": {"layer_specs": [spec]}}))
    assert plan[ROW] == [] and plan[COLUMN] == []
    preset = summary(build_plan(_llama(), 2, {"preset_model": "llama"}))
    assert len(preset[ROW]) == 4 and len(preset[COLUMN]) == 10 and preset[SKIP] == ["lm_head"]


def test_uneven_dimension_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"'mlp\.0'.*out_features=15 is not divisible by autotp_size=2"):
        build_plan(_Net(mid=15), 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by autotp_size=4"):
        build_plan(_llama(heads=4, kv=2, hidden=64), 4)


def test_unsupported_style_and_tied_head():
    model = _llama()
    model._tp_plan = {"lm_head": "sequence_parallel"}
    with pytest.raises(ValueError, match=r"unsupported partition style\(s\) \['sequence_parallel'\] \(keys \['lm_head'\]\)"):
        build_plan(model, 2)
    net = _Net()
    net.lm_head = nn.Linear(8, 10)
    net.lm_head.weight = net.embed.weight
    net.mlp[2] = nn.Linear(16, 8)
    assert build_plan(net, 2)["lm_head"].kind == SKIP


def test_config_section_accepted_and_checked():
    ok = DeepSpeedConfig({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False,
                          "preset_model": "llama", "partition_config": {"use_default_specs": True, "layer_specs": [
                              {"patterns": ["x"], "partition_type": "row"}]}}}, world_size=1)
    assert ok.model.tensor_parallel.autotp_size == 2
    fused = {"patterns": ["x"], "shape": [[8, 4, 4], -1]}
    DeepSpeedConfig({"train_batch_size": 2, "tensor_parallel": {"partition_config": {"layer_specs": [fused]}}},
                    world_size=1)
    for bad, where in (({"preset_model": "nope"}, "preset_model"),
                       ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [4, -1, 8]}]}}, "shape.*only 2-D"),
                       ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [[8, 0], -1]}]}}, "shape"),
                       ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_dim": 1}]}},
                        "partition_dim.*split on dim 0"),
                       ({"partition_config": {"layer_specs": [{"partition_type": "diagonal"}]}}, "partition_type"),
                       ({"autotp_size": -1}, "autotp_size")):
        with pytest.raises(DeepSpeedConfigError, match=where):
            DeepSpeedConfig({"train_batch_size": 2, "tensor_parallel": bad}, world_size=1)


def test_sharded_layer_forward_equals_linear_without_group():
    """tp size 1 (no group): the layers are plain Linear maths (the sharded case runs in tests/distributed)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    torch.manual_seed(0)
    a, b = nn.Linear(4, 6), nn.Linear(6, 3)
    x = torch.randn(2, 4)
    want = b(a(x))
    assert torch.equal(LinearAllreduce(b, None)(LinearLayer(a, None)(x)), want)


def test_fused_shape_plan_and_block_split():
    """`shape: [[8, 4, 4], -1]` (GQA-style q/k/v): the plan records the blocks, each rank's slice is its
    piece of every block in order, and joining the slices gives the weight back; a block tp does not
    divide is refused naming the layer and the block ([Note: fused sub-parameters])."""
    from deepspeed.module_inject.layers import LinearLayer

    net = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 4))
    specs = {"partition_config": {"layer_specs": [
        {"patterns": [r"0\.weight"], "partition_type": "column", "shape": [[8, 4, 4], -1]},
        {"patterns": [r"1\.weight"], "partition_type": "row"}]}}
    assert build_plan(net, 2, specs)["0"].sub_sizes == (8, 4, 4)
    with pytest.raises(ValueError, match=r"layer '0'.*fused sub-parameter of size 4 .*autotp_size=8"):
        build_plan(net, 8, specs)
    weight = torch.arange(64.0).view(16, 4)
    layers = []
    for rank in range(2):
        layer = LinearLayer(nn.Linear(4, 16), None, sub_sizes=(8, 4, 4))
        layer.tp_world_size, layer.tp_index = 2, rank
        layers.append(layer)
    slices = [layer._slice(weight, 0) for layer in layers]
    assert slices[0][:, 0].tolist() == [0, 4, 8, 12, 32, 36, 48, 52]   # q rows 0-3, k rows 8-9, v rows 12-13
    assert torch.equal(layers[0].join(slices, 0), weight)


def test_universal_checkpoint_info_names_each_parameter_layout():
    """upstream's model.universal_checkpoint_info: row weights, replicated (whole) parameters incl. a row
    layer's bias, the vocabulary-parallel LM head and fused blocks, each under its canonical name."""
    from deepspeed.checkpoint.constants import (ORIGINAL_VOCAB_SIZE, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                                PARAMETER_WITH_SUB_PARAMS, TP_REPLICATED_PARAMETER_PATTERNS,
                                                VOCABULARY_PARAMETER_PATTERNS)
    from deepspeed.checkpoint.tp_maps import split_map
    from deepspeed.module_inject.layers import (LinearAllreduce, LinearLayer, SubParamLinearLayer,
                                                collect_autotp_universal_checkpoint_info)

    net = nn.Module()
    net.norm = nn.LayerNorm(8)
    net.qkv = SubParamLinearLayer(nn.Linear(8, 12), None, name="qkv", sub_sizes=(4, 4, 4))
    net.o_proj = LinearAllreduce(nn.Linear(8, 8), None, name="o_proj")
    net.lm_head = LinearLayer(nn.Linear(8, 10, bias=False), None, gather_output=True, name="lm_head")
    info = collect_autotp_universal_checkpoint_info(net)
    assert info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^o_proj\.weight$"]
    assert info[TP_REPLICATED_PARAMETER_PATTERNS] == [r"^norm\.bias$", r"^norm\.weight$", r"^o_proj\.bias$"]
    assert info[VOCABULARY_PARAMETER_PATTERNS] == [r"^lm_head\.weight$"] and info[ORIGINAL_VOCAB_SIZE] == 10
    assert [e["patterns"] for e in info[PARAMETER_WITH_SUB_PARAMS]] == [[r"^qkv\.weight$"], [r"^qkv\.bias$"]]
    assert info[PARAMETER_WITH_SUB_PARAMS][0]["shape"] == [(4, 4, 4), -1]
    assert info["sub_param_shard_widths"][r"^qkv\.weight$"] == [[4], [4], [4]]   # upstream's 0.4 key
    maps = info["affine_map"]   # one affine map per parameter, in upstream's encoding
    assert maps["version"] == 1
    assert sorted(maps["params"]) == sorted(rf"^{re.escape(n)}$" for n, _ in net.named_parameters())
    assert maps["params"][r"^qkv\.weight$"] == split_map((12, 8), 0, (4, 4, 4), 1).to_dict()
    assert maps["params"][r"^norm\.weight$"] == split_map((8,), None, None, 1).to_dict()


def test_hf_tp_plan_skips_the_instance_copy_of_the_base_plan():
    """transformers copies the base plan into the instance `_tp_plan` under "model."; without a base module
    that copy must not become a second pattern, and the class's lm_head entry survives the instance plan."""
    config = type("Config", (), {"base_model_tp_plan": {"layers.*.q_proj": "colwise"}})()
    model = nn.Module()
    model.config = config
    model._tp_plan = {"layers.*.q_proj": "colwise", "model.layers.*.q_proj": "colwise", "extra": "rowwise"}
    assert hf_tp_plan(model) == {"layers.*.q_proj": "colwise", "extra": "rowwise"}


def test_weights_partitioned_by_zero_init_are_refused():
    """A model built under zero.Init holds ZeRO-3 shards (empty placeholders), not matrices to slice."""
    from deepspeed.module_inject.auto_tp import shard_model
    from deepspeed.runtime.errors import NotSupportedYet

    model = _Net()
    model.attn.q_proj.weight.data = torch.empty(0)
    model.attn.q_proj.weight.ds_status = "NOT_AVAILABLE"
    with pytest.raises(NotSupportedYet, match="zero.Init"):
        shard_model(model, 2, None, None)


class _CustomLinear(nn.Module):   # a linear-like leaf that is not nn.Linear
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x @ self.weight.T + self.bias


def test_custom_linear_like_module_named_by_a_spec_is_adopted_as_a_linear():
    """Upstream shards a custom module with a 2-D weight when an explicit spec names it; one that no spec
    shards (matched first by a skip spec, or a non-leaf) stays as written."""
    from deepspeed.module_inject.auto_tp import _as_linear
    from deepspeed.module_inject.tp_plan import linear_like, linear_like_to_adopt

    model = nn.Sequential(_CustomLinear(), _CustomLinear(), _CustomLinear(), nn.GELU())
    specs = lambda *rules: {"partition_config": {"use_default_specs": False, "layer_specs": [  # noqa: E731
        {"patterns": [p], "partition_type": t} for p, t in rules]}}
    assert linear_like(model[0]) and not linear_like(model[3]) and not linear_like(model)
    cfg = specs((r"^0\.weight$", "column"), (r"^1\.weight$", "skip"), (r"^[12]\.weight$", "row"))
    assert linear_like_to_adopt(model, cfg) == ["0", "2"]   # "1": the skip spec matches first
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    linear = _as_linear(model[0])
    assert isinstance(linear, nn.Linear) and linear.weight is model[0].weight and linear.bias is model[0].bias
    assert torch.equal(linear(x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))


def test_nested_shape_outside_partition_dim_names_upstream_phrase():
    from deepspeed.module_inject.autotp_config import AutoTPConfig

    with pytest.raises(ValueError, match="nested tuple only allowed at partition_dim"):
        AutoTPConfig.from_dict({"layer_specs": [{"patterns": [".*"], "partition_type": "column",
                                                 "shape": [2, [1, 1]]}]})
