"""AutoEP's data types, under DeepSpeed's names: the parsed `expert_parallel` section
(AutoEPConfig), a model family's preset (MoEModelPreset), one detected MoE block (MoELayerSpec) and
the per-family adapter that resolves what a preset leaves to the model config (AutoEPPresetAdapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional, Union

from torch import nn

_UNSET = object()   # "key absent" for fields where an explicit null means something else


def unsupported_load_balance_coeff(value: object) -> str:
    """The one message for a non-null load_balance_coeff (the engine's config section says it too)."""
    return (f"load_balance_coeff={value!r} is not supported: expert_bias (auxiliary-loss-free load balancing) is not "
            "built; set load_balance_coeff to null or omit the key")


def _raise_unsupported_load_balance_coeff(value: object) -> NoReturn:
    raise ValueError(f"expert_parallel.{unsupported_load_balance_coeff(value)}")


@dataclass
class MoEModelPreset:
    """Where one model family keeps its MoE blocks and how it routes."""

    moe_layer_pattern: str
    router_pattern: str
    experts_pattern: str
    expert_storage: str   # "fused_3d" or "module_list"
    expert_w1: str
    expert_w2: str
    expert_w3: Optional[str]
    num_experts_attr: str
    top_k_attr: str
    score_func: str   # "softmax" or "sigmoid"
    score_apply: str   # "pre" or "post"
    route_norm: bool
    gate_bias: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    expert_activation: str = "swiglu"
    autoep_config_defaults: dict = field(default_factory=dict)
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple = ()
    preset_adapter: str = "default"
    hf_model_types: tuple = ()
    unsupported_hf_model_type_notes: dict = field(default_factory=dict)
    min_transformers_version: Optional[str] = None


@dataclass
class MoELayerSpec:
    """One detected MoE block: names of its children and the routing it needs."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: str
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: Optional[str]
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: str
    score_apply: str
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: str   # "moe_block", "router" or "none"
    router_logits_capture_index: Optional[int]
    router_logits_capture_layer_name: Optional[str]
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    group_score_func: str = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple = ()
    preset_adapter: str = "default"
    expert_activation: str = "swiglu"


@dataclass
class AutoEPConfig:
    """The `expert_parallel` section as AutoEP reads it (auto_ep_config.parse_autoep_config)."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: Optional[str] = None
    moe_layer_pattern: Optional[str] = None
    expert_pattern: Optional[str] = None
    router_pattern: Optional[str] = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: Optional[bool] = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    score_func: str = "auto"
    top_k: Union[int, str] = "auto"
    load_balance_coeff: Any = _UNSET
    routed_scaling_factor: Union[float, str] = "auto"
    expert_w1: Optional[str] = None
    expert_w2: Optional[str] = None
    expert_w3: Any = _UNSET
    num_experts_attr: Optional[str] = None
    top_k_attr: Optional[str] = None
    has_shared_experts: Optional[bool] = None
    shared_experts_pattern: Optional[str] = None
    shared_experts_gate_pattern: Optional[str] = None
    expert_activation: Optional[str] = None
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._load_balance_coeff_explicit = self.load_balance_coeff is not _UNSET
        if self.load_balance_coeff is _UNSET:
            self.load_balance_coeff = None


@dataclass(frozen=True)
class GroupRoutingConfig:
    num_expert_groups: Optional[int]
    num_limited_groups: Optional[int]
    group_score_func: str = "top2_sum"


class AutoEPPresetAdapter:
    """What a preset leaves to the model: compatibility checks, top-k normalisation, group-limited
    routing, the expert storage. Families override what differs."""

    requires_transformers_version = False

    def validate_compatibility(self, preset_name: str, preset: MoEModelPreset, model_config: Any) -> None:
        model_type = getattr(model_config, "model_type", None) if model_config is not None else None
        if model_type is None:
            return
        note = preset.unsupported_hf_model_type_notes.get(model_type)
        if note is not None:
            raise ValueError(f"AutoEP preset {preset_name!r} does not support model_type={model_type!r}: {note} "
                             f"Supported model_type values: {list(preset.hf_model_types)}")
        if (self.requires_transformers_version and preset.min_transformers_version
                and model_type in preset.hf_model_types):
            from packaging.version import InvalidVersion, Version

            installed = self._installed_transformers_version()
            try:
                too_old = Version(installed) < Version(preset.min_transformers_version)
            except InvalidVersion:
                too_old = True
            if too_old:
                raise ValueError(f"AutoEP preset {preset_name!r} needs transformers >= "
                                 f"{preset.min_transformers_version} (the fused expert layout); installed: {installed}")

    def _installed_transformers_version(self) -> str:
        import transformers

        return str(getattr(transformers, "__version__", "0"))

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        if config.route_norm is not None:
            return bool(config.route_norm)
        declared = getattr(model_config, "norm_topk_prob", None)
        return preset.route_norm if declared is None else bool(declared)

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        return GroupRoutingConfig(config.num_expert_groups, config.num_limited_groups)

    def resolve_expert_layout(self, experts: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        return preset
