"""DeepSpeed 0.19.8's router alias of a whole-block AutoEP layer, in state dicts.

[Note: AutoEP router alias]
Upstream's `AutoEPMoELayer` registers its router twice when the router's logits are recorded there
(its presets mixtral, qwen3_moe, qwen3_5_moe retarget Transformers' recorders to the router; other
presets when the router class has `_can_record_outputs`): as `router` and under the MoE block's own
router name (`gate`). Its state dict therefore holds `<block>.gate.gate.weight` beside
`<block>.router.gate.weight`: one tensor under two names, and its strict `load_state_dict` wants both.
Ours registers the router once (named_parameters, ZeRO units and buffers see it once either way), but
its state dict writes the alias entries as upstream's (the router's tensors themselves, so torch.save
writes their storage once), and its loads accept them: an alias entry equal to the router's is
dropped, one alone is read as the router's, one that differs is refused by name (a corrupt or foreign
checkpoint: upstream would load whichever came last). `drop_alias_entries` is that one rule: the
layer's load pre-hook and every checkpoint reader (runtime/checkpoint/autoep_io.drop_router_aliases)
use it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# upstream's adapters of these presets retarget the model's router-logit recorders to the router
_ROUTER_RECORDED = frozenset({"mixtral", "qwen3_moe", "qwen3_5_moe"})


def router_capture(block: Any, router: Any, preset_adapter: str) -> tuple[str, Optional[str]]:
    """(router_logits_capture_target, router_logits_capture_layer_name) as upstream's forward contract
    gives them for a block and its router child."""
    target, layer_name = "none", None
    if hasattr(type(router), "_can_record_outputs"):
        target = "router"
        recorded = type(router)._can_record_outputs
        for value in (recorded.values() if isinstance(recorded, dict) else ()):
            if isinstance(value, dict):
                layer_name = value.get("layer_name", None)
    if getattr(block, "_can_record_outputs", None):
        target = "moe_block"
    if preset_adapter in _ROUTER_RECORDED:
        target = "router"
    return target, layer_name


def router_alias_name(spec: Any, layer: Any) -> Optional[str]:
    """The name upstream's layer also registers its router under, or None (upstream's rule, checked
    once the router is set and before the experts are)."""
    name = spec.router_logits_capture_layer_name or spec.router_name
    if spec.router_logits_capture_target != "router" or name == "router":
        return None
    if "." in name or name in ("experts", "shared_experts") or hasattr(layer, name):
        return None   # (upstream skips it with a warning: a name collision)
    return name


def drop_alias_entries(state: dict, prefix: str, alias: str, source: str = "state dict") -> None:
    """Remove from `state` (in place) the entries `<prefix><alias>.<k>`: equal to `<prefix>router.<k>`, or
    moved there when that entry is absent. An alias entry that differs from the router's raises a
    CheckpointError naming both keys and `source`."""
    from ..checkpoint.files import CheckpointError

    head, router = f"{prefix}{alias}.", f"{prefix}router."
    for key in [k for k in state if k.startswith(head)]:
        target = router + key[len(head):]
        value = state.pop(key)
        if target not in state:
            state[target] = value
            continue
        mine = state[target]
        same = torch.is_tensor(value) and torch.is_tensor(mine) and value.shape == mine.shape and \
            value.dtype == mine.dtype and ("meta" in (value.device.type, mine.device.type) or torch.equal(value, mine))
        if not same:
            raise CheckpointError(
                f"{source}: {key!r} differs from {target!r}: DeepSpeed's AutoEP layer registers its router also "
                f"as {alias!r}, so these entries are one tensor in any checkpoint it or this build writes; "
                f"this one is corrupt or from another model ({_describe(value)} vs {_describe(mine)})")


def _describe(value: Any) -> str:
    return f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else type(value).__name__


def add_alias_entries(layer: Any, state: dict, prefix: str, local_metadata: Any = None) -> None:
    """state_dict hook: `<prefix><alias>.<k>` for each router entry, the router's tensor itself, placed after
    the router's entries as upstream's registration order puts them."""
    alias = getattr(layer, "router_alias", None)
    if alias is None:
        return
    mine = [(k, state[k]) for k in list(state) if k.startswith(prefix)]   # this layer's: the last ones
    ordered, router = [], f"{prefix}router."
    for i, (key, value) in enumerate(mine):
        ordered.append((key, value))
        if key.startswith(router) and not (i + 1 < len(mine) and mine[i + 1][0].startswith(router)):
            ordered += [(f"{prefix}{alias}.{k[len(router):]}", v) for k, v in mine if k.startswith(router)]
    for key, _ in mine:
        del state[key]
    state.update(ordered)
