"""The `expert_parallel` section: AutoEP for Hugging Face MoE models (docs/moe.md).

Upstream's keys are all read. AutoEP here keeps each HF block's own router (routing identical to the
HF model by construction, [Note: the AutoEP plan]), so the routing overrides upstream offers are
accepted only at the values that mean "as the model does" and refused otherwise; performance knobs
(grouped GEMM, combine kernel) are accepted and have no effect on this pure-PyTorch path.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

from pydantic import Field

from .base import DSModel, Int, Problem, not_supported

_AS_MODEL = "AutoEP keeps the Hugging Face block's own router, so routing follows the model's config"


class ExpertParallelConfig(DSModel):
    """AutoEP: shard the experts of a Hugging Face MoE model over `autoep_size` ranks."""

    enabled: bool = False
    """Swap the model's MoE experts for expert-parallel ones at deepspeed.initialize."""
    autoep_size: Int = Field(1, ge=1)
    """Expert-parallel size: each rank holds num_experts / autoep_size experts; it must divide the world
    size and every block's expert count. 1: every rank holds every expert (no all-to-all)."""
    preset_model: Optional[str] = None
    """mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3; None: chosen from config.model_type."""
    moe_layer_pattern: Optional[str] = None
    """Regular expression fully matching the MoE blocks' module names (overrides the preset's)."""
    expert_pattern: Optional[str] = None
    """The block's experts child (a direct attribute name; preset: "experts")."""
    router_pattern: Optional[str] = None
    """The block's router child (a direct attribute name; preset: "gate")."""
    expert_w1: Optional[str] = None
    """Name of the fused [E, 2I, H] gate/up parameter (preset: "gate_up_proj")."""
    expert_w2: Optional[str] = None
    """Name of the fused [E, H, I] down parameter (preset: "down_proj")."""
    expert_w3: Optional[Any] = None
    """Upstream's separate up projection: only the fused layout (null) is supported here."""
    num_experts_attr: Optional[str] = None
    """model.config attribute holding the expert count (checked against the parameters)."""
    top_k_attr: Optional[str] = None
    """model.config attribute holding top-k (the HF router reads it itself)."""
    has_shared_experts: Optional[bool] = None
    """Shared experts stay dense, replicated modules of the block; accepted."""
    shared_experts_pattern: Optional[str] = None
    """Upstream's shared-expert child name; accepted (shared experts are not sharded)."""
    shared_experts_gate_pattern: Optional[str] = None
    """Upstream's shared-expert gate child name; accepted."""
    expert_tensor_parallel_size: Int = Field(1, ge=1)
    """Upstream's expert tensor parallelism: only 1 here."""
    validate_folding_routing: bool = False
    """Upstream's AutoEP+AutoTP folding check; accepted (no folding here)."""
    use_grouped_mm: bool = True
    """Upstream's grouped-GEMM kernel switch; accepted, experts run as per-expert matmuls here."""
    disable_triton_grouped_mm: bool = False
    """Accepted, no effect."""
    combine_impl: str = "auto"
    """auto, weighted_sum or legacy_bmm: the combine is the HF weighted sum here."""
    route_norm: Optional[bool] = None
    """Unset: the HF router's own top-k normalisation (norm_topk_prob); a value must equal it."""
    route_scale: float = 1.0
    """Only 1.0: the HF router's weights are used as they are."""
    score_apply: str = "auto"
    """auto or post: the HF experts weight their outputs (post)."""
    score_func: str = "auto"
    """Only auto: the HF router's own score function."""
    top_k: Union[int, str] = "auto"
    """Only auto: the HF router's own top-k (config.num_experts_per_tok)."""
    num_expert_groups: Optional[int] = None
    """Group-limited routing override: only null (the model's own routing)."""
    num_limited_groups: Optional[int] = None
    """Group-limited routing override: only null."""
    routed_scaling_factor: Union[float, str] = "auto"
    """Only auto: the model's own scaling factor."""
    load_balance_coeff: Any = None
    """Only null: expert-bias load balancing is not built (upstream refuses a non-null value too)."""

    def _problems(self) -> Iterator[Problem]:
        if self.preset_model is not None:
            from ....module_inject.auto_ep_plan import PRESETS

            if self.preset_model not in PRESETS:
                yield "preset_model", f"unknown preset {self.preset_model!r}; known: {sorted(PRESETS)}"
        for key in ("expert_pattern", "router_pattern", "expert_w1", "expert_w2", "num_experts_attr", "top_k_attr"):
            value = getattr(self, key)
            if value is not None and (not value or "." in value):
                yield key, f"must be a non-empty direct attribute name (no dots), got {value!r}"
        if self.moe_layer_pattern is not None:
            import re

            try:
                re.compile(self.moe_layer_pattern)
            except re.error as exc:
                yield "moe_layer_pattern", f"not a regular expression ({exc}): {self.moe_layer_pattern!r}"
        if self.expert_w3 is not None:
            yield "expert_w3", not_supported(f"separate (unfused) expert up projections (expert_w3="
                                             f"{self.expert_w3!r})", "leave it out: Transformers 5.x fuses gate/up")
        if self.expert_tensor_parallel_size != 1:
            yield "expert_tensor_parallel_size", not_supported(
                f"expert tensor parallelism (expert_tensor_parallel_size={self.expert_tensor_parallel_size})",
                "set it to 1")
        if self.combine_impl not in ("auto", "weighted_sum", "legacy_bmm"):
            yield "combine_impl", f"must be one of 'auto', 'weighted_sum', 'legacy_bmm', got {self.combine_impl!r}"
        if self.score_apply not in ("auto", "post"):
            yield "score_apply", f"only 'auto' or 'post' (the HF experts weight their outputs), got {self.score_apply!r}"
        fixed = {"score_func": (self.score_func, "auto"), "top_k": (self.top_k, "auto"),
                 "route_scale": (self.route_scale, 1.0), "num_expert_groups": (self.num_expert_groups, None),
                 "num_limited_groups": (self.num_limited_groups, None),
                 "routed_scaling_factor": (self.routed_scaling_factor, "auto")}
        for key, (value, default) in fixed.items():
            if value != default:
                yield key, not_supported(f"overriding the model's routing ({key}={value!r}): {_AS_MODEL}",
                                         f"leave it out or set it to {default!r}")
        if self.load_balance_coeff is not None:
            from ....module_inject.auto_ep_presets.base import unsupported_load_balance_coeff

            yield "load_balance_coeff", unsupported_load_balance_coeff(self.load_balance_coeff)
