"""AutoTP's sharding plan: which Linear layers are column-parallel, row-parallel or replicated (pure).

[Note: the AutoTP plan]
A plan maps each `nn.Linear`'s module name to a `LayerPlan` (column / row / skip, and whether a column
layer gathers its output). It is decided from the first source that applies, in this order:

1. explicit `tensor_parallel.partition_config.layer_specs` (regexes matched, as upstream, with
   `re.match` against "<module>.weight"; with `preset_model` and `use_default_specs` the explicit specs
   come first and the preset's follow); a Linear no spec matches stays replicated; a spec's `shape`
   splits a fused weight block by block ([Note: fused sub-parameters] in autotp_config.py);
2. `preset_model` alone (built-in specs for common architectures);
3. the Hugging Face model's `tp_plan` (the model's `_tp_plan`, its base model's, and the config's
   `base_model_tp_plan` under the base model's prefix), converted to specs by TPPlanConverter:
   `colwise` -> column, `rowwise` -> row, `colwise_gather_output`/`colwise_rep` -> column with the
   output gathered; a plan with any other style is refused whole;
4. upstream's automatic rule: in each module whose direct children hold two or more Linear layers,
   the output projections (o_proj, down_proj, out_proj, dense_4h_to_h, fc2, wo, w2, c_proj) are row-
   parallel and the others column-parallel; where none of those names occur, the last Linear is row-
   parallel and the ones before it column-parallel. A Linear alone in its parent, the LM head
   (lm_head / embed_out) and Linear layers tied to an embedding stay replicated.

A column layer needs `out_features`, a row layer `in_features` (each fused block), divisible by the TP size; and a model
whose config has head counts needs `num_attention_heads` and `num_key_value_heads` divisible by it
(else a head would be split across ranks). Anything else is refused with an error naming the layer;
uneven shards are not made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torch import nn

from .autotp_config import PRESETS, PartitionType, TPLayerSpec, spec_from_dict
from .tp_plan_converter import TPPlanConverter

COLUMN, ROW, SKIP = PartitionType.COLUMN.value, PartitionType.ROW.value, PartitionType.SKIP.value
ROW_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "fc2", "wo", "w2", "c_proj"})
HEAD_NAMES = frozenset({"lm_head", "embed_out"})


@dataclass(frozen=True)
class LayerPlan:
    kind: str                  # COLUMN, ROW or SKIP
    gather_output: bool = False
    source: str = "auto"       # which rule decided it (for error messages and docs)
    sub_sizes: tuple[int, ...] | None = None   # fused blocks along the split dim ([Note: fused sub-parameters])


def specs_from_config(tp_config: dict) -> list[TPLayerSpec] | None:
    """The explicit and preset specs of a `tensor_parallel` section, None when it has neither."""
    preset = tp_config.get("preset_model")
    partition = tp_config.get("partition_config") or None
    if preset is None and partition is None:
        return None
    specs: list[TPLayerSpec] = []
    if partition is not None:
        for i, raw in enumerate(partition.get("layer_specs") or []):
            specs.append(spec_from_dict(dict(raw), f"tensor_parallel.partition_config.layer_specs[{i}]"))
    if preset is not None and (partition is None or partition.get("use_default_specs", True)):
        if str(preset).lower() not in PRESETS:
            raise ValueError(f"tensor_parallel.preset_model={preset!r}: unknown preset; known: {sorted(PRESETS)}")
        specs += [spec_from_dict(s, f"preset {preset}") for s in PRESETS[str(preset).lower()]]
    return specs


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tp_plan with keys relative to `model` (empty when it has none)."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    lead = f"{prefix}." if has_base else ""
    for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        plan[lead + key] = style
    base = getattr(model, prefix, None) if has_base else None
    for key, style in (getattr(base, "_tp_plan", None) or {}).items():
        plan[lead + key] = style
    base_keys = {k[len(lead):] for k in plan}
    # transformers expands the base plan into the instance's `_tp_plan` under the base prefix ("model."
    # by default): such an entry repeats a base-plan key already placed above, so it is skipped (as upstream)
    head = f"{prefix or 'model'}."
    repeated = lambda key: key.startswith(head) and key[len(head):] in base_keys  # noqa: E731
    for key, style in (getattr(type(model), "_tp_plan", None) or {}).items():
        if not repeated(key):
            plan.setdefault(key, style)
    for key, style in (getattr(model, "_tp_plan", None) or {}).items():
        if not repeated(key):
            plan[key] = style
    return plan


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]


def linear_like(module: nn.Module) -> bool:
    """A leaf module whose parameters are a 2-D `weight` [out, in] and an optional 1-D `bias` [out]: what an
    explicit layer spec may shard as a Linear (upstream's "custom linear-like modules"); its forward is
    then taken to be x @ weight.T + bias."""
    if isinstance(module, nn.Linear) or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    return (weight is not None and weight.dim() == 2 and set(params) <= {"weight", "bias"}
            and (bias is None or tuple(bias.shape) == (weight.shape[0],)))


def linear_like_to_adopt(model: nn.Module, tp_config: dict | None) -> list[str]:
    """Names of the linear-like modules ([linear_like]) whose first matching explicit layer spec shards them."""
    specs = specs_from_config(dict(tp_config or {})) or []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = []
    for name, module in model.named_modules():
        if name and linear_like(module):
            spec = next((s for s in specs if s.matches(name + ".weight", model_type)), None)
            if spec is not None and spec.partition_type.value != SKIP:
                names.append(name)
    return names


def _tied_to_embedding(model: nn.Module) -> set[str]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name for name, m in _linears(model) if id(m.weight) in embeddings}


def _from_specs(model: nn.Module, specs: list[TPLayerSpec], source: str = "layer_specs") -> dict[str, LayerPlan]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    plan = {}
    for name, linear in _linears(model):
        spec = next((s for s in specs if s.matches(name + ".weight", model_type)), None)
        if spec is None:
            plan[name] = LayerPlan(SKIP, False, source)
            continue
        kind = spec.partition_type.value
        try:
            sub = spec.sub_sizes(linear.out_features if kind == COLUMN else linear.in_features)
        except ValueError as e:
            raise ValueError(f"AutoTP: layer {name!r} (Linear {linear.in_features}->{linear.out_features}): "
                             f"{e}") from None
        plan[name] = LayerPlan(kind, spec.gather_output, source, sub)
    return plan


def plan_specs(model: nn.Module, tp_config: dict | None) -> tuple[list[TPLayerSpec] | None, str]:
    """The specs the plan follows (sources 1-3 of [Note: the AutoTP plan]) and their source; None: the
    automatic rule. A Hugging Face plan goes through TPPlanConverter (a style AutoTP does not provide
    rejects the whole plan)."""
    specs = specs_from_config(dict(tp_config or {}))
    if specs is not None:
        return specs, "layer_specs"
    return TPPlanConverter.convert(_outside_autoep(model, hf_tp_plan(model))), "tp_plan"


def _autoep_names(model: nn.Module) -> list[str]:
    """The names of the model's AutoEP layers (experts swapped or blocks replaced by AutoEP)."""
    from .auto_ep_layer import autoep_layers

    found = {id(m) for m in autoep_layers(model)}
    return [name for name, m in model.named_modules() if id(m) in found]


def autoep_shared_expert_names(model: nn.Module) -> list[str]:
    """The shared experts (and their gates) of the model's whole-block AutoEP layers: dense modules
    run on every token of the layer's replicated input, which AutoTP shards like any MLP (upstream's
    AutoTP does too); the router and the routed experts stay whole."""
    return [f"{name}.{child}" for name, m in model.named_modules() if getattr(m, "_is_autoep_layer", False)
            for child in ("shared_experts", "shared_experts_gate") if getattr(m, child, None) is not None]


def _outside_autoep(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan without the entries addressing an AutoEP layer or anything inside it: AutoEP owns
    those experts ([Note: EP x TP folding] in moe/tp_tokens.py), as upstream's AutoTP skips them."""
    owned = [name.split(".") for name in _autoep_names(model)]

    def inside(key: str) -> bool:
        parts = key.split(".")
        return any(len(parts) >= len(o) and all(p in ("*", q) for p, q in zip(parts, o)) for o in owned)

    return {k: v for k, v in plan.items() if not inside(k)} if owned else plan


def grad_allreduce_modules(model: nn.Module, tp_config: dict | None) -> list[str]:
    """Modules kept whole whose first matching spec has `grad_allreduce` (Hugging Face's
    `replicated_with_grad_allreduce`, e.g. Qwen3's per-head q_norm/k_norm after a column q_proj): each TP
    rank's backward gives only its own heads' share of their gradient, so it is summed over the TP group
    (auto_tp.sum_grads_over_tensor_group)."""
    specs, _ = plan_specs(model, tp_config)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = []
    for name, _ in model.named_modules():
        spec = next((s for s in specs or () if name and s.matches(name + ".weight", model_type)), None)
        if spec is not None and spec.grad_allreduce and spec.partition_type.value == SKIP:
            names.append(name)
    return names


def _automatic(model: nn.Module) -> dict[str, LayerPlan]:
    plan = {name: LayerPlan(SKIP) for name, _ in _linears(model)}
    for parent_name, parent in model.named_modules():
        children = [(n, c) for n, c in parent.named_children() if isinstance(c, nn.Linear) and n not in HEAD_NAMES]
        if len(children) < 2:
            continue
        named_rows = [n for n, _ in children if n in ROW_NAMES]
        rows = set(named_rows) if named_rows else {children[-1][0]}
        for n, _ in children:
            full = f"{parent_name}.{n}" if parent_name else n
            plan[full] = LayerPlan(ROW if n in rows else COLUMN)
    return plan


def build_plan(model: nn.Module, tp_size: int, tp_config: dict | None = None) -> dict[str, LayerPlan]:
    """The plan for every Linear of `model` ([Note: the AutoTP plan]); raises ValueError naming the
    layer when a sharded dimension does not divide by `tp_size`."""
    specs, source = plan_specs(model, tp_config)
    plan = _automatic(model) if specs is None else _from_specs(model, specs, source)
    dense = autoep_shared_expert_names(model)
    for owner in _autoep_names(model):   # AutoEP's routers and experts stay whole; its shared experts follow the plan
        for name in [n for n in plan if n.startswith(owner + ".")]:
            if not any(name == d or name.startswith(d + ".") for d in dense):
                plan[name] = LayerPlan(SKIP, False, "inside an AutoEP layer")
    for name in _tied_to_embedding(model):   # a vocabulary-parallel embedding is not provided: keep both whole
        plan[name] = LayerPlan(SKIP, False, "tied to an embedding")
    check_plan(model, plan, tp_size)
    return plan


def check_plan(model: nn.Module, plan: dict[str, LayerPlan], tp_size: int) -> None:
    modules = dict(model.named_modules())
    for name, layer in plan.items():
        if layer.kind == SKIP:
            continue
        linear = modules[name]
        what = "out_features" if layer.kind == COLUMN else "in_features"
        width = getattr(linear, what)
        for size in layer.sub_sizes or (width,):
            if size % tp_size:
                part = f"{what}={width}" if layer.sub_sizes is None else \
                    f"the fused sub-parameter of size {size} (of {what}={width}, blocks {list(layer.sub_sizes)})"
                raise ValueError(f"AutoTP: layer {name!r} (Linear {linear.in_features}->{linear.out_features}) is "
                                 f"{layer.kind}-parallel ({layer.source}) but {part} is not divisible by "
                                 f"autotp_size={tp_size}; choose a tp size that divides it or mark the layer 'skip' "
                                 "in tensor_parallel.partition_config.layer_specs")
    if any(layer.kind != SKIP for layer in plan.values()):
        check_heads(getattr(model, "config", None), tp_size)


def check_heads(config: Any, tp_size: int) -> None:
    """Attention heads are the unit of a column split of q/k/v: each must stay on one rank."""
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(f"AutoTP: the model config's {key}={heads} is not divisible by autotp_size={tp_size}: "
                             "a head would be split across ranks; choose a tp size that divides every head count")


def summary(plan: dict[str, LayerPlan]) -> dict[str, list[str]]:
    """{kind: [layer names]} (for logs and tests)."""
    out: dict[str, list[str]] = {COLUMN: [], ROW: [], SKIP: []}
    for name, layer in plan.items():
        out[layer.kind].append(name)
    return out


def sharded_names(plan: dict[str, LayerPlan]) -> Iterable[str]:
    return (name for name, layer in plan.items() if layer.kind != SKIP)
