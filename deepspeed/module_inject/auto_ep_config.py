"""AutoEP's reading of the `expert_parallel` section, under DeepSpeed's names: parse it into an
AutoEPConfig, validate it against the topology, then against the detected MoE blocks, and fill
what the user left out from the Hugging Face model config.

The engine validates the same section through its pydantic model
(runtime/config/sections/expert_parallel.py), which also refuses what this build's engine path
does not do; these functions are the library API (AutoEP(model, config) in auto_ep.py).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

from .auto_ep_presets.base import _UNSET, AutoEPConfig, MoELayerSpec, MoEModelPreset, _raise_unsupported_load_balance_coeff
from .auto_ep_folding import build_folding_spec, validate_folding_global
from .auto_ep_presets.registry import PRESET_MODELS, available_preset_names, resolve_autoep_config_defaults

__all__ = ["_UNSET", "AutoEPConfig", "MoELayerSpec", "MoEModelPreset", "PRESET_MODELS", "parse_autoep_config",
           "resolve_autoep_config_defaults", "validate_autoep_config", "validate_autoep_post_detection",
           "fill_autoep_config_from_hf"]

_CHOICES = {"score_apply": ("auto", "pre", "post"), "combine_impl": ("auto", "weighted_sum", "legacy_bmm"),
            "score_func": ("auto", "softmax", "sigmoid")}
_FOLDING_OPTIONS = ("zero_stage", "deepcompile_enabled", "use_data_before_expert_parallel", "mpu",
                    "zero_offload_optimizer", "zero_offload_param")
_ATTR_NAMES = ("expert_w1", "expert_w2", "num_experts_attr", "top_k_attr", "router_pattern", "expert_pattern",
               "shared_experts_pattern", "shared_experts_gate_pattern")


def parse_autoep_config(param_dict: Optional[dict]) -> AutoEPConfig:
    """The section as an AutoEPConfig; keys left out keep their defaults. A non-null
    `load_balance_coeff` is refused here (expert-bias balancing is not built)."""
    param_dict = dict(param_dict or {})
    if param_dict.get("load_balance_coeff") is not None:
        _raise_unsupported_load_balance_coeff(param_dict["load_balance_coeff"])
    known = {f.name for f in fields(AutoEPConfig) if f.init}
    return AutoEPConfig(**{k: v for k, v in param_dict.items() if k in known})


def validate_autoep_config(config: AutoEPConfig, world_size: int, pp_size: int, tp_size: int, sp_size: int,
                           **options: Any) -> None:
    """Errors (ValueError naming the key) for a section that cannot run on this topology."""
    if config.load_balance_coeff is not None:
        _raise_unsupported_load_balance_coeff(config.load_balance_coeff)
    for key in ("validate_folding_routing", "async_split_plan"):
        if not isinstance(getattr(config, key), bool):
            raise ValueError(f"expert_parallel.{key} must be a boolean, got {getattr(config, key)!r}")
    if not config.enabled:
        return
    ep = config.autoep_size
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_parallel.autoep_size must be a positive integer, got {ep!r}")
    folding = build_folding_spec(world_size=world_size, pp_size=pp_size, tp_size=max(tp_size, 1), ep_size=ep,
                                 etp_size=config.expert_tensor_parallel_size)
    validate_folding_global(folding, sp_size=sp_size, ep_preset=config.preset_model,
                            tp_preset=options.get("tp_preset_model"), **{
        k: v for k, v in options.items() if k in _FOLDING_OPTIONS})
    if config.preset_model is not None and config.preset_model not in PRESET_MODELS:
        raise ValueError(f"expert_parallel.preset_model={config.preset_model!r}: unknown; available presets: "
                         f"{list(available_preset_names())}")
    for key, allowed in _CHOICES.items():
        if getattr(config, key) not in allowed:
            raise ValueError(f"expert_parallel.{key} must be one of {allowed}, got {getattr(config, key)!r}")
    for key in ("num_expert_groups", "num_limited_groups"):
        value = getattr(config, key)
        if value is not None and value < 1:
            raise ValueError(f"expert_parallel.{key} must be >= 1, got {value}")
    if None not in (config.num_expert_groups, config.num_limited_groups) and \
            config.num_limited_groups > config.num_expert_groups:
        raise ValueError(f"expert_parallel.num_limited_groups ({config.num_limited_groups}) must be <= "
                         f"num_expert_groups ({config.num_expert_groups})")
    names = [(key, getattr(config, key)) for key in _ATTR_NAMES]
    if config.expert_w3 is not _UNSET and config.expert_w3 is not None:
        names.append(("expert_w3", config.expert_w3))
    for key, value in names:
        if value is not None and (not isinstance(value, str) or not value or "." in value):
            raise ValueError(f"expert_parallel.{key} must be a non-empty direct attribute name (no dots), got {value!r}")
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise ValueError(f"expert_parallel.has_shared_experts must be a boolean, got {config.has_shared_experts!r}")
    factor = config.routed_scaling_factor
    if factor != "auto" and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
        raise ValueError(f"expert_parallel.routed_scaling_factor must be a number or 'auto', got {factor!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_autoep_post_detection(config: AutoEPConfig, specs: list[MoELayerSpec]) -> None:
    """Errors for an autoep_size or group routing the detected blocks cannot take."""
    if not config.enabled:
        return
    ep = config.autoep_size
    for spec in specs:
        where = f"layer {spec.moe_module_name!r}"
        if ep > spec.num_experts:
            raise ValueError(f"expert_parallel.autoep_size={ep} exceeds num_experts={spec.num_experts} in {where}: "
                             f"each rank must own at least one expert; valid values: {_divisors(spec.num_experts)}")
        if spec.num_experts % ep:
            raise ValueError(f"expert_parallel.autoep_size={ep} does not divide num_experts={spec.num_experts} in "
                             f"{where}; valid values: {_divisors(spec.num_experts)}")
        groups = spec.num_expert_groups if spec.num_expert_groups is not None else config.num_expert_groups
        limited = spec.num_limited_groups if spec.num_limited_groups is not None else config.num_limited_groups
        if groups is None:
            if limited is not None:
                raise ValueError(f"num_limited_groups needs num_expert_groups in {where}")
            continue
        if groups < 1 or spec.num_experts % groups:
            raise ValueError(f"num_expert_groups={groups} must be >= 1 and divide num_experts={spec.num_experts} "
                             f"in {where}")
        if limited is None or not 1 <= limited <= groups:
            raise ValueError(f"num_limited_groups={limited} must be set, >= 1 and <= num_expert_groups={groups} "
                             f"in {where}")


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: Any) -> None:
    """Group-limited routing (n_group, topk_group) and routed_scaling_factor from the HF config,
    where the section leaves them unset."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto" and getattr(model_config, "routed_scaling_factor", None) is not None:
        config.route_scale = float(model_config.routed_scaling_factor)
