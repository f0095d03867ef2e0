"""AutoEP: expert parallelism for the MoE blocks of a Hugging Face model, two ways.

`apply_autoep` (the engine's, with the `expert_parallel` section, runtime/engine_autoep.py) swaps
only the experts child of each Transformers 5.x block (auto_ep_plan.py decides which,
auto_ep_layer.ExpertParallelExperts runs them): the block keeps its own router, so routing is the
model's by construction. The `AutoEP` class (DeepSpeed's API: `ep_parser()`, `replace_moe_layer()`)
replaces whole blocks by AutoEPMoELayer, routing as the preset describes: for blocks that compute
their experts themselves (remote code, nn.ModuleList experts), which the experts swap refuses."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch import nn

from .. import comm as ds_comm
from ..moe.fused_expert_layout import classify_fused_gate_up_layout
from .auto_ep_layer import AutoEPMoELayer, ExpertParallelExperts, autoep_layers
from .auto_ep_plan import NeedsBlockReplacement, build_plan
from .auto_ep_presets.base import MoELayerSpec
from .auto_ep_alias import router_capture
from .auto_ep_presets.registry import get_preset_adapter, resolve_preset_candidates


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _broadcast(t: torch.Tensor, src: int, group: Any) -> None:
    """Broadcast in place; a host tensor travels through the accelerator under a device backend
    (the engine moves the module to its device only after the swap)."""
    buf = t
    if t.device.type == "cpu" and ds_comm.get_backend(group) != "gloo":
        from ..accelerator import get_accelerator

        buf = t.to(get_accelerator().current_device_name())
    ds_comm.broadcast(buf, src=src, group=group)
    if buf is not t:
        t.copy_(buf)


def apply_autoep(model: nn.Module, section: dict, ep_size: int, *, broadcast_group: Any = None,
                 use_data_before_expert_parallel: bool = False, tensor_fold: Optional[tuple] = None) -> list:
    """Shard `model`'s MoE experts over `ep_size` ranks in place ([Note: the AutoEP plan]); returns
    the plan. Collective (every rank, same arguments): builds the `ep_size_<ep>` expert groups and
    first broadcasts each fused expert tensor from the first rank of `broadcast_group` (the whole
    world when None), so every EP rank cuts its slice from the same experts, as AutoTP does. A model
    already swapped for this `ep_size` is left as it is. `tensor_fold` = (tensor group, size, rank)
    under AutoTP: the expert groups fold over the tensor dim and the tensor peers share the routed
    assignments ([Note: folded assignment dispatch] in moe/ep_tp_dispatch.py)."""
    done = autoep_layers(model)
    if done:
        if any(layer.ep_size != ep_size for layer in done):
            raise ValueError(f"expert_parallel.autoep_size={ep_size} but the model's experts are already "
                             f"sharded for ep_size {sorted({layer.ep_size for layer in done})}")
        return []
    try:
        plans: list = build_plan(model, section, ep_size)
    except NeedsBlockReplacement as exc:
        plans, swap_error = [], exc
    else:
        swap_error = None
    from ..utils import groups

    world = ds_comm.get_world_size()
    if world % ep_size:
        raise ValueError(f"expert_parallel.autoep_size={ep_size} must divide the world size {world}")
    if tensor_fold is not None:
        from .auto_ep_folding import build_folding_spec

        spec = build_folding_spec(world_size=world, pp_size=1, tp_size=int(tensor_fold[1]), ep_size=ep_size)
        groups._create_expert_and_data_parallel(ep_size, folding_spec=spec)
    else:
        groups._create_expert_and_data_parallel(ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel)
    name = f"ep_size_{ep_size}"
    group, rank = groups._get_expert_parallel_group(name), groups._get_expert_parallel_rank(name)
    src = ds_comm.get_global_rank(broadcast_group, 0) if broadcast_group is not None else 0

    def same_experts(experts: nn.Module, names: Any) -> None:
        """Every EP rank cuts its slice from the same experts (those of the first rank of `broadcast_group`)."""
        if ds_comm.get_world_size(broadcast_group) > 1:
            for w in names:
                _broadcast(getattr(experts, w).data, src, broadcast_group)

    if swap_error is not None:
        plans = _replace_blocks(model, section, ep_size, rank, group, same_experts, swap_error)
    else:
        for plan in plans:
            original = model.get_submodule(plan.experts_name)
            same_experts(original, (plan.w1, plan.w2))
            _set_child(model, plan.experts_name,
                       ExpertParallelExperts(original, plan.w1, plan.w2, plan.num_experts, ep_size, rank, group))
    handles = _folding_handles(spec, name, tensor_fold) if tensor_fold is not None else None
    for layer in autoep_layers(model):
        layer.tensor_fold, layer.folding_group_handles = tensor_fold, handles
        layer.tp_group = tensor_fold[0] if tensor_fold is not None else None
        layer.validate_folding_routing = bool(section.get("validate_folding_routing", False))
    return plans


def _folding_handles(spec: Any, name: str, tensor_fold: tuple) -> Any:
    """This rank's groups of the folded layout, as upstream's FoldingGroupHandles."""
    from ..runtime import mesh
    from ..utils import groups
    from .auto_ep_folding import FoldingGroupHandles

    parallel = mesh.current()
    return FoldingGroupHandles(spec=spec, tp_group=tensor_fold[0], dense_dp_group=parallel.group("data"),
                               ep_group=groups._get_expert_parallel_group(name),
                               edp_group=groups._get_expert_data_parallel_group(name), ep_group_name=name,
                               tp_ranks=tuple(parallel.ranks("tensor")), dense_dp_ranks=tuple(parallel.ranks("data")),
                               ep_ranks=tuple(groups._get_expert_parallel_group_ranks(name)),
                               edp_ranks=tuple(groups._get_expert_data_parallel_group_ranks(name)))


def _replace_blocks(model: nn.Module, section: dict, ep_size: int, rank: int, group: Any, same_experts: Any,
                    swap_error: Exception) -> list:
    """apply_autoep for blocks that compute their experts themselves: the AutoEP class replaces each
    whole block (routing as the preset describes); returns the layers' specs."""
    from .auto_ep_config import parse_autoep_config, validate_autoep_post_detection

    config = parse_autoep_config({**section, "enabled": True, "autoep_size": ep_size})
    auto_ep = AutoEP(model, config)
    try:
        specs = auto_ep.ep_parser()
    except ValueError as exc:
        raise ValueError(f"{swap_error}; replacing the whole block failed too: {exc}") from exc
    if not specs:
        raise swap_error
    validate_autoep_post_detection(config, specs)
    for spec in specs:
        experts = model.get_submodule(spec.moe_module_name).get_submodule(spec.experts_name)
        same_experts(experts, [n for n, _ in experts.named_parameters()])
        auto_ep.replace_moe_layer(spec, ep_size, rank).ep_group = group
    return specs


# -- the AutoEP class: whole-block replacement (DeepSpeed's API) ------------------------------------
def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _resolve_route_scale(config: Any, model_config: Any) -> float:
    """The one scale the router applies: routed_scaling_factor when given, else the model config's
    routed_scaling_factor (DeepSeek), else route_scale."""
    if config.routed_scaling_factor != "auto":
        return _finite(config.routed_scaling_factor, "expert_parallel.routed_scaling_factor")
    declared = getattr(model_config, "routed_scaling_factor", None)
    if declared is not None:
        return _finite(declared, "model.config.routed_scaling_factor")
    return _finite(config.route_scale, "expert_parallel.route_scale")


def _shape(param: Any) -> tuple:
    """A parameter's full shape, also when ZeRO-3 has partitioned it (ds_shape)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _sizes(experts: nn.Module, preset: Any, storage: str) -> Optional[tuple[int, int]]:
    """(hidden, ffn) from the expert weights' shapes; None when they fit no known layout."""
    if storage == "module_list":
        w1 = getattr(experts[0], preset.expert_w1, None)
        w1 = getattr(w1, "weight", w1)
        return (_shape(w1)[1], _shape(w1)[0]) if isinstance(w1, torch.Tensor) and len(_shape(w1)) == 2 else None
    w1, w2 = _shape(getattr(experts, preset.expert_w1)), _shape(getattr(experts, preset.expert_w2))
    if preset.expert_w3:
        return w1[2], w1[1]
    layout = classify_fused_gate_up_layout(w1, w2)
    return (layout.hidden_size, layout.ffn_hidden_size) if layout else None


class AutoEP:
    """Finds a model's MoE blocks (`ep_parser()`: one MoELayerSpec each, from the presets) and
    replaces each by an AutoEPMoELayer holding one EP rank's experts (`replace_moe_layer`)."""

    def __init__(self, model: nn.Module, config: Any) -> None:
        self.model, self.config = model, config
        self.model_config = getattr(model, "config", None)

    def _resolve_presets(self) -> list:
        return resolve_preset_candidates(self.config, self.model_config)

    def _config_int(self, attr: str) -> Optional[int]:
        value = getattr(self.model_config, attr, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _spec(self, name: str, block: nn.Module, preset_name: str, preset: Any) -> Optional[MoELayerSpec]:
        adapter = get_preset_adapter(preset.preset_adapter)
        experts, router = getattr(block, preset.experts_pattern, None), getattr(block, preset.router_pattern, None)
        if experts is None or router is None:
            return None   # a dense MLP at a position the pattern also matches
        preset = adapter.resolve_expert_layout(experts, preset)
        fused = all(isinstance(getattr(experts, w, None), torch.Tensor) and len(_shape(getattr(experts, w))) == 3
                    for w in (preset.expert_w1, preset.expert_w2))
        storage = "fused_3d" if fused else "module_list" if isinstance(experts, nn.ModuleList) and len(experts) else None
        if storage is None:
            return None
        sizes = _sizes(experts, preset, storage)
        if sizes is None:
            raise ValueError(f"AutoEP: preset {preset_name!r} matched {name}, but the shapes of its expert weights "
                             f"{preset.expert_w1!r}/{preset.expert_w2!r} fit no known layout")
        weight = getattr(router, "weight", None)
        num_experts = self._config_int(preset.num_experts_attr)
        if weight is not None and len(_shape(weight)) == 2:
            if num_experts is not None and num_experts != _shape(weight)[0]:
                raise ValueError(f"AutoEP: config.{preset.num_experts_attr}={num_experts} but {name}'s router has "
                                 f"{_shape(weight)[0]} outputs")
            num_experts = _shape(weight)[0]
            if sizes[0] != _shape(weight)[1]:
                raise ValueError(f"AutoEP: {name}: expert hidden size {sizes[0]} != router input {_shape(weight)[1]}")
        top_k = self.config.top_k if isinstance(self.config.top_k, int) else (
            self._config_int(preset.top_k_attr) or getattr(block, "top_k", None))
        if num_experts is None or top_k is None or top_k > num_experts:
            raise ValueError(f"AutoEP: {name}: num_experts={num_experts}, top_k={top_k} (set model.config."
                             f"{preset.num_experts_attr}/{preset.top_k_attr} or expert_parallel.top_k)")
        declared = getattr(self.model_config, "scoring_func", None)
        score_func = self.config.score_func if self.config.score_func != "auto" else (
            declared if declared in ("softmax", "sigmoid") else preset.score_func)
        groups = adapter.resolve_group_routing(self.config, self.model_config)
        shared = preset.shared_experts_pattern if preset.has_shared_experts and preset.shared_experts_pattern and \
            getattr(block, preset.shared_experts_pattern, None) is not None else ""
        shared_gate = preset.shared_experts_gate_pattern if shared and preset.shared_experts_gate_pattern and \
            getattr(block, preset.shared_experts_gate_pattern, None) is not None else ""
        capture = router_capture(block, router, preset.preset_adapter)   # [Note: AutoEP router alias]
        return MoELayerSpec(
            moe_module_name=name, model_family=preset_name, router_name=preset.router_pattern,
            experts_name=preset.experts_pattern, expert_storage=storage, expert_w1_name=preset.expert_w1,
            expert_w2_name=preset.expert_w2, expert_w3_name=preset.expert_w3, num_experts=num_experts, top_k=top_k,
            hidden_size=sizes[0], ffn_hidden_size=sizes[1], score_func=score_func,
            score_apply=preset.score_apply if self.config.score_apply == "auto" else self.config.score_apply,
            route_norm=adapter.resolve_route_norm(self.config, preset, self.model_config),
            gate_bias=getattr(router, "bias", None) is not None, return_router_logits=False,
            router_logits_capture_target=capture[0], router_logits_capture_index=None,
            router_logits_capture_layer_name=capture[1], has_shared_experts=bool(shared), shared_experts_name=shared,
            shared_experts_gate_name=shared_gate, route_scale=_resolve_route_scale(self.config, self.model_config),
            num_expert_groups=groups.num_expert_groups, num_limited_groups=groups.num_limited_groups,
            group_score_func=groups.group_score_func, supports_expert_bias=preset.supports_expert_bias,
            unsupported_router_bias_names=preset.unsupported_router_bias_names, preset_adapter=preset.preset_adapter,
            expert_activation=preset.expert_activation)

    def ep_parser(self) -> list[MoELayerSpec]:
        """One spec per MoE block, in module order (the first preset that finds blocks wins)."""
        candidates = self._resolve_presets()
        for preset_name, preset in candidates:
            pattern = re.compile(preset.moe_layer_pattern)
            specs = [spec for name, block in self.model.named_modules() if pattern.fullmatch(name)
                     for spec in [self._spec(name, block, preset_name, preset)] if spec is not None]
            if specs:
                return specs
        if self.config.preset_model is not None or self.config.moe_layer_pattern is not None:
            expected = "; ".join(f"{n}: moe_layer_pattern={p.moe_layer_pattern!r}, router={p.router_pattern!r}, "
                                 f"experts={p.experts_pattern!r}" for n, p in candidates)
            raise ValueError(f"AutoEP: no MoE layers detected; expected {expected}")
        return []

    def replace_moe_layer(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> AutoEPMoELayer:
        source = self.model.get_submodule(spec.moe_module_name)
        layer = AutoEPMoELayer(spec, source, ep_size, ep_rank, self.config)
        _set_child(self.model, spec.moe_module_name, layer)
        return layer

    def replace_moe_layers(self, specs: list[MoELayerSpec], ep_size: int, ep_rank: int) -> list[AutoEPMoELayer]:
        return [self.replace_moe_layer(spec, ep_size, ep_rank) for spec in specs]
