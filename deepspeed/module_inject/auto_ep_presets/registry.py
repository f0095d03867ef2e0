"""The built-in AutoEP presets (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3) and how
one is chosen for a model: by name (`preset_model`), else by the HF `config.model_type`, else by
the section's own `moe_layer_pattern`, else every preset is tried. The section's pattern keys
override the chosen preset's fields. auto_ep_plan.py (the engine's experts swap) reads the same table.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from .base import _UNSET, AutoEPConfig, AutoEPPresetAdapter, GroupRoutingConfig, MoEModelPreset

_FUSED = dict(moe_layer_pattern=r"model\.layers\.\d+\.mlp", router_pattern="gate", experts_pattern="experts",
              expert_storage="fused_3d", expert_w1="gate_up_proj", expert_w2="down_proj", expert_w3=None,
              top_k_attr="num_experts_per_tok", score_apply="post", gate_bias=False, min_transformers_version="5.0.0")
_NO_EXPERT_BIAS = dict(autoep_config_defaults={"load_balance_coeff": None}, supports_expert_bias=False)

PRESET_MODELS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(**_FUSED, num_experts_attr="num_local_experts", score_func="softmax", route_norm=True,
                              preset_adapter="mixtral", hf_model_types=("mixtral", )),
    "qwen3_moe": MoEModelPreset(**_FUSED, num_experts_attr="num_experts", score_func="softmax", route_norm=True,
                                has_shared_experts=True, shared_experts_pattern="shared_expert",
                                shared_experts_gate_pattern="shared_expert_gate", preset_adapter="qwen3_moe",
                                hf_model_types=("qwen3_moe", "qwen2_moe")),
    "qwen3_5_moe": MoEModelPreset(**{**_FUSED, "min_transformers_version": "5.2.0"}, num_experts_attr="num_experts",
                                  score_func="softmax", route_norm=True, has_shared_experts=True,
                                  shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
                                  preset_adapter="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", ),
                                  unsupported_hf_model_type_notes={"qwen3_5_moe": (
                                      "replacing whole blocks covers the Qwen3.5 text backbone: pass the text model "
                                      "(model_type 'qwen3_5_moe_text'); the engine's expert_parallel section handles "
                                      "the composite model.")}),
    "deepseek_v2": MoEModelPreset(**_FUSED, **_NO_EXPERT_BIAS, num_experts_attr="n_routed_experts",
                                  score_func="softmax", route_norm=False, has_shared_experts=True,
                                  shared_experts_pattern="shared_experts", preset_adapter="deepseek_v2",
                                  hf_model_types=("deepseek_v2", )),
    "deepseek_v3": MoEModelPreset(**_FUSED, **_NO_EXPERT_BIAS, num_experts_attr="n_routed_experts",
                                  score_func="sigmoid", route_norm=False, has_shared_experts=True,
                                  shared_experts_pattern="shared_experts", preset_adapter="deepseek_v3",
                                  hf_model_types=("deepseek_v3", )),
}


class _VersionCheckedAdapter(AutoEPPresetAdapter):
    requires_transformers_version = True


class _DeepSeekV2Adapter(_VersionCheckedAdapter):
    """Top-k weights as the model leaves them (no norm_topk_prob lookup); group-limited greedy
    routing (max score per group) when the config asks for it."""

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        return preset.route_norm if config.route_norm is None else bool(config.route_norm)

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        if getattr(model_config, "topk_method", None) != "group_limited_greedy":
            return base
        return GroupRoutingConfig(base.num_expert_groups or getattr(model_config, "n_group", None),
                                  base.num_limited_groups or getattr(model_config, "topk_group", None), "max")


class _ModuleListExpertsAdapter(_VersionCheckedAdapter):
    """DeepSeek-V3: group-limited routing from n_group/topk_group; experts may be an nn.ModuleList
    of gate_proj/up_proj/down_proj MLPs (older Transformers and remote code)."""

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        return GroupRoutingConfig(base.num_expert_groups or getattr(model_config, "n_group", None),
                                  base.num_limited_groups or getattr(model_config, "topk_group", None))

    def resolve_expert_layout(self, experts: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        if isinstance(experts, nn.ModuleList) and len(experts) and preset.expert_w1 == "gate_up_proj":
            return replace(preset, expert_storage="module_list", expert_w1="gate_proj", expert_w2="down_proj",
                           expert_w3="up_proj")
        return preset


_PRESET_ADAPTERS: dict[str, AutoEPPresetAdapter] = {
    "default": AutoEPPresetAdapter(),
    "mixtral": AutoEPPresetAdapter(),
    "qwen3_moe": AutoEPPresetAdapter(),
    "qwen3_5_moe": _VersionCheckedAdapter(),
    "deepseek_v2": _DeepSeekV2Adapter(),
    "deepseek_v3": _ModuleListExpertsAdapter(),
}


def available_preset_names() -> tuple[str, ...]:
    return tuple(PRESET_MODELS)


def get_preset(preset_name: str) -> MoEModelPreset:
    if preset_name not in PRESET_MODELS:
        raise ValueError(f"Unknown preset_model {preset_name!r}. Available presets: {list(PRESET_MODELS)}")
    return PRESET_MODELS[preset_name]


def get_preset_adapter(adapter_name: str) -> AutoEPPresetAdapter:
    if adapter_name not in _PRESET_ADAPTERS:
        raise ValueError(f"Unknown AutoEP preset adapter {adapter_name!r}; known: {list(_PRESET_ADAPTERS)}")
    return _PRESET_ADAPTERS[adapter_name]


def preset_name_for_hf_model_type(model_type: str) -> Optional[str]:
    """The preset that supports this HF model_type, or None."""
    return next((name for name, p in PRESET_MODELS.items() if model_type in p.hf_model_types), None)


def unsupported_preset_for_hf_model_type(model_type: str) -> Optional[tuple[str, MoEModelPreset]]:
    """(name, preset) of a preset that knows this model_type and explains why it refuses it, or None."""
    return next(((name, p) for name, p in PRESET_MODELS.items() if model_type in p.unsupported_hf_model_type_notes),
                None)


def resolve_autoep_config_defaults(config: AutoEPConfig, preset_name: Optional[str]) -> AutoEPConfig:
    """`config` with the preset's own defaults for the keys the user left out (a copy when any apply)."""
    defaults = PRESET_MODELS[preset_name].autoep_config_defaults if preset_name in PRESET_MODELS else {}
    if "load_balance_coeff" not in defaults or config._load_balance_coeff_explicit:
        return config
    resolved = copy.copy(config)
    resolved.load_balance_coeff = defaults["load_balance_coeff"]
    return resolved


_OVERRIDES = {"moe_layer_pattern": "moe_layer_pattern", "router_pattern": "router_pattern",
              "expert_pattern": "experts_pattern", "expert_w1": "expert_w1", "expert_w2": "expert_w2",
              "num_experts_attr": "num_experts_attr", "top_k_attr": "top_k_attr",
              "has_shared_experts": "has_shared_experts", "shared_experts_pattern": "shared_experts_pattern",
              "shared_experts_gate_pattern": "shared_experts_gate_pattern", "expert_activation": "expert_activation"}


def apply_config_overrides(config: AutoEPConfig, preset: MoEModelPreset) -> MoEModelPreset:
    """The preset with the section's explicit pattern keys in place of its own."""
    given = {field: getattr(config, key) for key, field in _OVERRIDES.items() if getattr(config, key) is not None}
    if config.expert_w3 is not _UNSET:
        given["expert_w3"] = config.expert_w3
    return replace(preset, **given) if given else preset


def _custom_preset(config: AutoEPConfig) -> MoEModelPreset:
    return apply_config_overrides(config, MoEModelPreset(
        **{**_FUSED, "min_transformers_version": None}, num_experts_attr="num_local_experts",
        score_func=config.score_func if config.score_func != "auto" else "softmax",
        route_norm=True if config.route_norm is None else bool(config.route_norm)))


def resolve_preset_candidates(config: AutoEPConfig, model_config: Any) -> list[tuple[str, MoEModelPreset]]:
    """The presets to detect MoE blocks with, in order (see the module docstring)."""
    name = config.preset_model
    if name is None and model_config is not None:
        model_type = getattr(model_config, "model_type", None)
        name = preset_name_for_hf_model_type(model_type) if model_type else None
        if name is None and model_type:
            refusing = unsupported_preset_for_hf_model_type(model_type)
            if refusing is not None:
                get_preset_adapter(refusing[1].preset_adapter).validate_compatibility(*refusing, model_config)
    if name is not None:
        preset = apply_config_overrides(config, get_preset(name))
        get_preset_adapter(preset.preset_adapter).validate_compatibility(name, preset, model_config)
        return [(name, preset)]
    if config.moe_layer_pattern:
        return [("custom", _custom_preset(config))]
    return [(n, apply_config_overrides(config, p)) for n, p in PRESET_MODELS.items()]
