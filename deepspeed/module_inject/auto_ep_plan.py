"""AutoEP's plan: which modules of a Hugging Face model are MoE blocks and which experts each
expert-parallel (EP) rank keeps. Pure: reads module names, attributes and shapes, builds no group.

[Note: the AutoEP plan]
A preset names, for one model family, the MoE blocks (`moe_layer_pattern`, a regular expression
fully matching the block's module name), the block's router child (`router_pattern`) and its
experts child (`expert_pattern`), whose fused 3-D parameters (`expert_w1` = gate_up_proj
[E, 2I, H], `expert_w2` = down_proj [E, H, I]: Transformers 5.x layout) are split on dim 0. With
`preset_model` unset the preset is chosen from `model.config.model_type`; the config's own
patterns override the preset's. EP rank r of `ep` keeps experts [r*E/ep, (r+1)*E/ep): contiguous,
so gathering the slices in EP-rank order restores the original tensor.

Only the experts child is swapped (auto_ep_layer.ExpertParallelExperts); the block, its router
and any shared experts stay the Hugging Face modules, so routing (top-k, softmax, norm_topk_prob,
jitter) and the router logits the HF aux loss reads are the block's own by construction.
A block that computes its experts itself (no Transformers 5.x experts call, or nn.ModuleList
experts) cannot keep its router this way (NeedsBlockReplacement): apply_autoep replaces it whole
instead (auto_ep.AutoEP, routing as the preset describes).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from torch import nn

from ..runtime.zero.stage3 import init_context
from .auto_ep_presets.base import MoEModelPreset
from .auto_ep_presets.registry import PRESET_MODELS


@dataclass(frozen=True)
class Preset:
    moe_layer_pattern: str = r"model\.layers\.\d+\.mlp"
    router_pattern: str = "gate"
    expert_pattern: str = "experts"
    expert_w1: str = "gate_up_proj"
    expert_w2: str = "down_proj"
    num_experts_attr: str = "num_experts"
    top_k_attr: str = "num_experts_per_tok"
    hf_model_types: tuple[str, ...] = ()


def _from_registry(preset: MoEModelPreset) -> Preset:
    """The experts swap's view of a registry preset. It also takes the model types the registry's
    whole-block replacement refuses with a note: keeping the HF block, it serves them."""
    return Preset(preset.moe_layer_pattern, preset.router_pattern, preset.experts_pattern, preset.expert_w1,
                  preset.expert_w2, preset.num_experts_attr, preset.top_k_attr,
                  preset.hf_model_types + tuple(preset.unsupported_hf_model_type_notes))


PRESETS: dict[str, Preset] = {name: _from_registry(p) for name, p in PRESET_MODELS.items()}
# the composite Qwen3.5 model keeps its text layers under model.language_model; Qwen3-Next shares the block
PRESETS["qwen3_5_moe"] = replace(PRESETS["qwen3_5_moe"], moe_layer_pattern=r"model\.(language_model\.)?layers\.\d+\.mlp",
                                 hf_model_types=PRESETS["qwen3_5_moe"].hf_model_types + ("qwen3_next", ))

# config keys that override a preset field of the same name
OVERRIDES = ("moe_layer_pattern", "router_pattern", "expert_pattern", "expert_w1", "expert_w2",
             "num_experts_attr", "top_k_attr")


@dataclass(frozen=True)
class BlockPlan:
    """One MoE block: its name, its experts child, the expert count and this plan's EP split."""

    name: str
    experts_name: str
    num_experts: int
    ep_size: int
    w1: str
    w2: str

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size


def owned_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global expert ids EP rank `ep_rank` keeps: a contiguous range of num_experts/ep_size."""
    local = num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


def resolve_preset(model: nn.Module, section: dict) -> tuple[str, Preset]:
    """The preset the section names, else the one whose hf_model_types holds the model's type; the
    section's own pattern keys override it. Without either, the section's patterns alone (the
    defaults fill the rest) when it gives `moe_layer_pattern`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = section.get("preset_model")
    if name is not None:
        if name not in PRESETS:
            raise ValueError(f"expert_parallel.preset_model={name!r}: unknown preset; known: {sorted(PRESETS)}")
        preset = PRESETS[name]
        if model_type is not None and preset.hf_model_types and model_type not in preset.hf_model_types:
            raise ValueError(f"expert_parallel.preset_model={name!r} is for model_type {list(preset.hf_model_types)}, "
                             f"but the model's config.model_type is {model_type!r}")
    else:
        name = next((n for n, p in PRESETS.items() if model_type in p.hf_model_types), None)
        if name is None and section.get("moe_layer_pattern") is None:
            raise ValueError(f"expert_parallel: no preset for model_type {model_type!r}; set preset_model (one of "
                             f"{sorted(PRESETS)}) or moe_layer_pattern (with expert_pattern, router_pattern)")
        preset = PRESETS.get(name, Preset()) if name else Preset()
    given = {k: section[k] for k in OVERRIDES if section.get(k) is not None}
    return name or "custom", replace(preset, **given)


def _config_int(model: nn.Module, attr: str) -> Optional[int]:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    value = getattr(config, attr, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class NeedsBlockReplacement(ValueError):
    """The block computes its experts itself (no Transformers 5.x experts call, or an nn.ModuleList
    of expert MLPs): swapping the experts child cannot serve it; apply_autoep replaces the whole
    block instead (auto_ep.AutoEP)."""


def _check_call_contract(block: str, child: str, experts: nn.Module) -> None:
    """Only the experts child is swapped, so the block must call it as Transformers 5.x does,
    `experts(hidden_states, top_k_index, top_k_weights)`, and never index its fused parameters
    itself (it would read local experts under global ids). Experts with no such forward raise
    NeedsBlockReplacement: apply_autoep then replaces the whole block (auto_ep.AutoEP)."""
    forward = type(experts).forward
    try:
        params = [p for p in inspect.signature(forward).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if forward is nn.Module.forward or (len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params)):
        raise NeedsBlockReplacement(f"expert_parallel: {block}.{child} ({type(experts).__name__}) has no "
                         "forward(hidden_states, top_k_index, top_k_weights); AutoEP swaps the experts module and "
                         "keeps the block's own routing, so the block must call its experts that way "
                         "(Transformers 5.x MoE blocks do)")


def build_plan(model: nn.Module, section: dict, ep_size: int) -> list[BlockPlan]:
    """Every MoE block of `model` the preset matches, in module order; an error (naming the block,
    the count and the allowed sizes) when an expert count does not split over `ep_size`."""
    _, preset = resolve_preset(model, section)
    pattern = re.compile(preset.moe_layer_pattern)
    plans: list[BlockPlan] = []
    for name, module in model.named_modules():
        if not pattern.fullmatch(name):
            continue
        experts = getattr(module, preset.expert_pattern, None)
        router = getattr(module, preset.router_pattern, None)
        if experts is None or router is None:
            continue   # a dense MLP at a position the pattern also matches (e.g. first_k_dense layers)
        if isinstance(experts, nn.ModuleList):
            raise NeedsBlockReplacement(f"expert_parallel: {name}.{preset.expert_pattern} is an nn.ModuleList of "
                                        "expert modules, not a Transformers 5.x fused experts module")
        w1, w2 = getattr(experts, preset.expert_w1, None), getattr(experts, preset.expert_w2, None)
        if any(init_context.init_shard(w) is not None for w in (w1, w2) if isinstance(w, nn.Parameter)):
            raise ValueError(f"expert_parallel: {name}.{preset.expert_pattern} holds zero.Init placeholders; "
                             "deepspeed.initialize makes MoE blocks whole before the swap (runtime/engine_autoep.py): "
                             "call apply_autoep through it, or materialize the block first")
        if not isinstance(w1, nn.Parameter) or not isinstance(w2, nn.Parameter) or w1.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"expert_parallel: {name}.{preset.expert_pattern} has no fused 3-D expert parameters "
                             f"{preset.expert_w1!r}/{preset.expert_w2!r} (Transformers 5.x layout); set "
                             "expert_w1/expert_w2 to their names")
        _check_call_contract(name, preset.expert_pattern, experts)
        norm = section.get("route_norm")
        has_norm = bool(getattr(router, "norm_topk_prob", getattr(module, "norm_topk_prob", True)))
        if norm is not None and bool(norm) != has_norm:
            raise ValueError(f"expert_parallel.route_norm={norm}: {name}'s router {'does' if has_norm else 'does not'} "
                             "normalise its top-k weights (norm_topk_prob) and AutoEP keeps the HF router; leave "
                             f"route_norm out or set it to {has_norm}")
        count = int(w1.shape[0])
        declared = _config_int(model, preset.num_experts_attr)
        if declared is not None and declared != count:
            raise ValueError(f"expert_parallel: {name} holds {count} experts but config.{preset.num_experts_attr} "
                             f"is {declared}")
        if count % ep_size:
            allowed = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(f"expert_parallel.autoep_size={ep_size}: {name} has {count} experts, which do not split "
                             f"evenly; allowed autoep_size values: {allowed}")
        plans.append(BlockPlan(name, f"{name}.{preset.expert_pattern}" if name else preset.expert_pattern,
                               count, ep_size, preset.expert_w1, preset.expert_w2))
    if not plans:
        raise ValueError(f"expert_parallel: no MoE block matched moe_layer_pattern={preset.moe_layer_pattern!r} "
                         f"with children {preset.router_pattern!r} and {preset.expert_pattern!r}")
    return plans


def ep_size_from_config(config: Any) -> int:
    """`expert_parallel.autoep_size` when the section is enabled, else 0 (AutoEP off)."""
    section = (config or {}).get("expert_parallel") if isinstance(config, dict) else None
    if not isinstance(section, dict) or not section.get("enabled", False):
        return 0
    return int(section.get("autoep_size", 1))
