"""AutoTP: replace a model's Linear layers by tensor-parallel ones following its plan (tp_plan.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers import (LinearAllreduce, LinearLayer, SubParamLinearAllreduce, SubParamLinearLayer,
                     attach_universal_checkpoint_info, tensor_parallel_size)
from .. import comm as ds_comm
from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec  # noqa: F401  (upstream imports them from here)
from .tp_plan import (COLUMN, SKIP, LayerPlan, build_plan, check_plan, grad_allreduce_modules, linear_like_to_adopt,
                      summary)


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def shard_model(model: nn.Module, tp_size: int, tp_config: dict | None, group: Any) -> dict[str, list[str]]:
    """Shard `model` in place for `tp_size` ranks over `group` ([Note: the AutoTP plan]); returns the
    plan's summary {kind: [layer names]}. A model already sharded for `tp_size` is left as it is."""
    have = tensor_parallel_size(model)
    if have == tp_size:
        return {}
    if have != 1:
        raise ValueError(f"AutoTP: the model is already sharded for tensor-parallel size {have}, not {tp_size}")
    partitioned = [n for n, p in model.named_parameters() if hasattr(p, "ds_status") and p.numel() == 0]
    if partitioned:   # built under zero.Init: its weights are ZeRO-3 shards, not whole matrices to slice
        from ..runtime.errors import NotSupportedYet

        raise NotSupportedYet(f"AutoTP (autotp_size={tp_size}): parameters {partitioned[:3]} are already partitioned "
                              "by zero.Init; build the model without zero.Init (ZeRO-3 partitions the TP slices at "
                              "deepspeed.initialize)")
    for name in linear_like_to_adopt(model, tp_config):   # a custom linear-like module a spec names: as a Linear
        _set_child(model, name, _as_linear(model.get_submodule(name)))
    plan = build_plan(model, tp_size, tp_config)
    modules = dict(model.named_modules())
    for name, layer in plan.items():
        if layer.kind != SKIP:
            _set_child(model, name, make_layer(modules[name], layer, group, name))
    for name in grad_allreduce_modules(model, tp_config):
        sum_grads_over_tensor_group(modules[name], group)
    attach_universal_checkpoint_info(model)
    return summary(plan)


def _as_linear(module: nn.Module) -> nn.Linear:
    """An nn.Linear holding `module`'s own weight and bias Parameters (no copy)."""
    out_features, in_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
    linear.weight = module.weight
    linear.bias = module.bias
    return linear


def sum_grads_over_tensor_group(module: nn.Module, group: Any) -> None:
    """Each backward's gradient of `module`'s (whole, replicated) parameters summed over the TP group, by a
    tensor hook: it runs before the gradient is accumulated into `.grad`, so once per micro-step on that
    micro-step's share, and before any data-parallel reduction or ZeRO partition sees it. The TP ranks
    then hold equal gradients, and clipping counts the parameter once (on TP rank 0, as every replicated one)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        ds_comm.all_reduce(total, group=group)
        return total

    for param in module.parameters():
        if param.requires_grad and not getattr(param, "_ds_grad_allreduce_registered", False):
            param.register_hook(hook)
            param._ds_grad_allreduce_registered = True   # upstream's flag


def make_layer(linear: nn.Linear, layer: LayerPlan, group: Any, name: str) -> nn.Module:
    """The tensor-parallel layer that replaces `linear` under its plan entry (fused: the SubParam kind)."""
    if layer.kind == COLUMN:
        cls = SubParamLinearLayer if layer.sub_sizes else LinearLayer
        return cls(linear, group, gather_output=layer.gather_output, name=name, sub_sizes=layer.sub_sizes)
    cls = SubParamLinearAllreduce if layer.sub_sizes else LinearAllreduce
    return cls(linear, group, name=name, sub_sizes=layer.sub_sizes)


def broadcast_for_tensor_parallel(model: nn.Module, group: Any) -> None:
    """Every TP rank cuts its slice from the same whole model: TP rank 0's (one broadcast per dtype)."""
    from ..runtime.engine_setup import broadcast_module_states

    broadcast_module_states(model, group)


def tp_size_from_config(config: Any) -> int:
    """`tensor_parallel.autotp_size` of a raw config dict (or a path to one); 1 when absent or 0."""
    if config is None:
        return 1
    if not isinstance(config, dict):
        from ..runtime.config import load_config_dict

        config = load_config_dict(config)
    section = config.get("tensor_parallel") or {}
    size = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def tensor_parallel_section(config: Any) -> dict:
    if config is None:
        return {}
    if not isinstance(config, dict):
        from ..runtime.config import load_config_dict

        config = load_config_dict(config)
    section = config.get("tensor_parallel") or {}
    return dict(section) if isinstance(section, dict) else {}


def cast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    return model.to(dtype) if dtype is not None else model


class AutoTP:
    """Upstream's class-level entry (`deepspeed.module_inject.auto_tp.AutoTP`) over the same plan: walks
    the module tree with each child's full dotted path and replaces the Linear layers a
    `partition_config` (AutoTPConfig) spec matches. `shard_model` is what the engine uses."""

    def __init__(self, module: nn.Module, all_reduce_linears: Any = (), prefix: str = "", state_dict: Any = None,
                 linear_layer_setting: Any = None, orig_layer_impl: Any = None, keep_module_on_host: bool = False,
                 partition_config: AutoTPConfig | None = None) -> None:
        self.module, self.prefix, self.partition_config = module, prefix, partition_config
        self.all_reduce_linears = list(all_reduce_linears or ())
        self.mp_size, self.mp_group = 1, None
        self.linear_policies = None

    def set_tensor_parallel_config(self, mp_size: int, mp_group: Any) -> None:
        self.mp_size, self.mp_group = mp_size, mp_group

    def update_linear_policies(self) -> None:
        self.linear_policies = {nn.Linear: self._replace_with_config}

    def _get_model_type(self) -> str | None:
        return getattr(getattr(self.module, "config", None), "model_type", None)

    def _replace_with_config(self, child: nn.Module, full_name: str) -> nn.Module | None:
        """The tensor-parallel layer for `child` (None: keep it) under the first matching spec; a Linear
        tied to an embedding stays whole (no vocabulary-parallel embedding here)."""
        if self.partition_config is None or not isinstance(child, nn.Linear):
            return None
        spec = self.partition_config.find_matching_spec(full_name + ".weight", self._get_model_type())
        if spec is None or spec.partition_type == PartitionType.SKIP:
            return None
        if id(child.weight) in {id(m.weight) for m in self.module.modules() if isinstance(m, nn.Embedding)}:
            return None
        kind = spec.partition_type.value
        layer = LayerPlan(kind, spec.gather_output, "partition_config",
                          spec.sub_sizes(child.out_features if kind == COLUMN else child.in_features))
        size = ds_comm.get_world_size(self.mp_group) if self.mp_group is not None else 1
        check_plan(nn.ModuleDict({"layer": child}), {"layer": layer}, size)
        return make_layer(child, layer, self.mp_group, full_name)

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        for name, child in list(r_module.named_children()):
            full_name = f"{prev_class_name}.{name}" if prev_class_name else name
            if getattr(child, "_is_autoep_layer", False):
                self._replace_autoep_shared_experts(child, full_name)
                continue
            self._replace_child(r_module, name, child, full_name)
        return r_module

    def _replace_child(self, parent: nn.Module, name: str, child: nn.Module, full_name: str) -> None:
        new = self._replace_with_config(child, full_name) if isinstance(child, nn.Linear) else None
        if new is not None:
            setattr(parent, name, new)
        elif not isinstance(child, nn.Linear):
            self._replace_module(child, name, full_name)

    def _replace_autoep_shared_experts(self, autoep_layer: nn.Module, autoep_name: str) -> None:
        """Inside a whole-block AutoEP layer only the shared experts and their gate are AutoTP's
        (tp_plan.autoep_shared_expert_names); the router and the routed experts stay whole."""
        for name in ("shared_experts", "shared_experts_gate"):
            child = getattr(autoep_layer, name, None)
            if child is not None:
                self._replace_child(autoep_layer, name, child, f"{autoep_name}.{name}" if autoep_name else name)
