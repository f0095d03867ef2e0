"""Per-head Muon (upstream's `"optimizer": {"type": "Muon", "params": {"per_head_muon": true}}`):
which attention projections Newton-Schulz orthogonalises head by head, and with how many heads.

[Note: per-head tagging]
Full-matrix NS couples every head of a projection; per head, each (head_dim, in) row block is
orthogonalised alone (original_muon.orthogonalize with `num_heads`). A parameter is split only
where its layout is confirmed, never guessed:
- its leaf module name claims a kind: query (q_proj, query, wq...), key/value (k_proj, v_proj,
  key, value, wk, wv...), MLA up-projection (q_b_proj, kv_b_proj), or "not head-blocked" (fused
  QKV, MLA down-projections); any other name (o_proj: heads on the input axis; MLP `dense`) is
  left whole;
- candidate geometries (heads, per-head width) come from the model config (head counts under the
  spellings models use, `text_config` first; width `head_dim` or hidden_size / heads, MLA widths
  qk_nope + qk_rope and qk_nope + v_head_dim) and, for q/k/v, from the owning module when its
  class name says it is attention (linear-attention layers carry their own head geometry);
- a candidate confirms only on rows == heads * width of the layer's shape (`ds_shape` under
  ZeRO-3), and confirmed candidates with different head counts are ambiguous: left whole.
Tagged parameters carry `muon_num_heads` and `muon_head_dim` (the width survives a column-parallel
split, the count does not: `resolve_per_head_muon_after_sharding`). An opt-in that tags nothing
raises: per-head would be silently off.
"""

from __future__ import annotations

from typing import Any

import torch

from ....utils.logging import logger

QUERY, KV, MLA_Q, MLA_KV, WHOLE = "query", "kv", "mla_q", "mla_kv", "not-head-blocked"
# leaf-name prefixes, checked in this order (kv_b_proj before k..., fused qkv before q...)
_KINDS = ((WHOLE, ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv", "q_a_proj", "kv_a_proj")),
          (MLA_Q, ("q_b_proj",)), (MLA_KV, ("kv_b_proj",)),
          (KV, ("k_proj", "key", "wk", "v_proj", "value", "wv")), (QUERY, ("q_proj", "query", "wq")))
_VALUE = ("v_proj", "value", "wv")
_Q_HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads")
# the owning attention module's own geometry, per projection: (head-count attributes, width attributes)
_OWNER = {"q": (_Q_HEADS, ("head_k_dim", "head_dim", "head_size")),
          "k": (("num_k_heads",) + _KV_HEADS + _Q_HEADS, ("head_k_dim", "head_dim", "head_size")),
          "v": (("num_v_heads", "num_k_heads") + _KV_HEADS + _Q_HEADS, ("head_v_dim", "head_dim", "head_size"))}


def layer_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape the parameter has as a layer (`ds_shape` while ZeRO-3 holds a flat placeholder)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(param.shape if shape is None else shape)


def _first_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _leaf(param_name: str) -> str:
    parts = param_name.lower().split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def _kind(leaf: str) -> str | None:
    return next((kind for kind, prefixes in _KINDS if leaf.startswith(prefixes)), None)


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _config_candidates(kind: str, config: Any) -> list[tuple[int, int, str]]:
    heads = _first_int(config, _Q_HEADS)
    if heads is None:
        return []
    kv_heads = _first_int(config, _KV_HEADS) or heads
    head_dim = _first_int(config, ("head_dim",))
    hidden = _first_int(config, ("hidden_size",))
    if head_dim is None and hidden is not None and hidden % heads == 0:
        head_dim = hidden // heads
    nope, rope, v_dim = (_first_int(config, (k,)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    found = []
    if kind in (QUERY, MLA_Q) and nope and rope:
        found.append((heads, nope + rope, "mla-q"))
    if kind == MLA_KV and nope and v_dim:
        found.append((heads, nope + v_dim, "mla-kv"))
    if kind in (QUERY, KV) and head_dim:
        found.append((heads if kind == QUERY else kv_heads, head_dim, "head-dim"))
    return found


def _owner_candidates(kind: str, leaf: str, param_name: str, modules: dict | None) -> list[tuple[int, int, str]]:
    if kind not in (QUERY, KV) or not modules:
        return []
    owner = modules.get(".".join(param_name.split(".")[:-2]))
    if owner is None or "attention" not in type(owner).__name__.lower():
        return []
    which = "q" if kind == QUERY else "v" if leaf.startswith(_VALUE) else "k"
    counts, widths = _OWNER[which]
    heads, width = _first_int(owner, counts), _first_int(owner, widths)
    return [(heads, width, f"owner-{which}")] if heads and width else []


def _confirm(param: torch.Tensor, candidates: list[tuple[int, int, str]]) -> tuple[int | None, str]:
    """(heads, source) of the candidates whose heads * width is exactly the layer's row count, or
    (None, why not): not a matrix, no candidate, none matches, or matches disagreeing on heads."""
    shape = layer_shape(param)
    if len(shape) != 2:
        return None, "not-2d"
    if not candidates:
        return None, "no-candidate-geometry"
    exact = sorted((c for c in candidates if c[0] * c[1] == shape[0]), key=lambda c: c[2])
    if not exact:
        return None, "width-mismatch"
    if len({c[0] for c in exact}) > 1:
        return None, "ambiguous:" + "/".join(f"{source}={heads}" for heads, _, source in exact)
    return exact[0][0], exact[0][2]


def _resolve(param_name: str, param: torch.Tensor, config: Any, modules: dict | None) -> tuple[int | None, str]:
    leaf = _leaf(param_name)
    kind = _kind(leaf)
    if kind is None:
        return None, "not-attention"
    if kind == WHOLE:
        return None, WHOLE
    candidates = (_config_candidates(kind, config) if config is not None else [])
    return _confirm(param, candidates + _owner_candidates(kind, leaf, param_name, modules))


def _modules(model: Any) -> dict | None:
    named = getattr(model, "named_modules", None)
    return dict(named()) if callable(named) else None


def _attention_head_count(param_name: str, param: torch.Tensor, model: Any) -> int | None:
    """Heads `param` (named `param_name` in `model`) splits into on dim 0, or None: keep it whole."""
    return _resolve(param_name, param, _text_config(model), _modules(model))[0]


def tag_per_head(model: torch.nn.Module, enabled: bool) -> None:
    """Set `muon_num_heads` / `muon_head_dim` on every parameter (None unless `enabled` and
    confirmed, Muon matrices only); raise when `enabled` tags nothing."""
    config, modules = (_text_config(model), _modules(model)) if enabled else (None, None)
    tagged, skipped = {}, {}
    for name, p in model.named_parameters():
        heads = None
        if enabled and getattr(p, "use_muon", False):
            heads, reason = _resolve(name, p, config, modules)
            if heads is None:
                skipped[_leaf(name)] = reason
            else:
                tagged[_leaf(name)] = f"{heads} heads of {layer_shape(p)[0] // heads} ({reason})"
        p.muon_num_heads = heads
        p.muon_head_dim = layer_shape(p)[0] // heads if heads else None
    if not enabled:
        return
    if not tagged:
        raise ValueError("optimizer.params.per_head_muon is enabled but no attention projection could be tagged, so "
                         "per-head Newton-Schulz would be off for every parameter: the model config has no head "
                         "geometry that matches the projections' shapes (a model already sharded by an external "
                         "tensor-parallel library, an unrecognised attention layout, or no attention at all); "
                         f"unset per_head_muon to train without it. Leaves examined: {dict(sorted(skipped.items()))}")
    unconfirmed = {k: v for k, v in skipped.items() if v not in (WHOLE, "not-attention")}
    if unconfirmed:
        logger.warning(f"per_head_muon: {dict(sorted(unconfirmed.items()))} look like attention projections but no "
                       "head geometry confirmed them; they keep the full-matrix path")
    logger.info(f"per_head_muon: tagged {dict(sorted(tagged.items()))}")


def resolve_per_head_muon_after_sharding(model: torch.nn.Module) -> None:
    """Re-derive `muon_num_heads` from the rows each rank holds (after a column-parallel split the
    per-head width is unchanged and the count is not; NS per head on a shard of whole heads is the
    matching blocks of NS per head on the whole matrix). A shard that cuts a head is left whole;
    raises when that leaves no parameter per-head."""
    tagged, dropped = 0, {}
    for name, p in model.named_parameters():
        width = getattr(p, "muon_head_dim", None)
        if width is None:
            continue
        rows = layer_shape(p)[0]
        if rows % width:
            p.muon_num_heads = None
            dropped[name] = f"{rows} rows do not divide into heads of {width}"
        else:
            p.muon_num_heads, tagged = rows // width, tagged + 1
    if dropped and not tagged:
        raise ValueError(f"per_head_muon: every tagged projection is sharded across head boundaries ({dropped}); "
                         "choose a tensor-parallel size that keeps whole heads per rank or unset per_head_muon")
    if dropped:
        logger.warning(f"per_head_muon: {dropped} hold partial heads after sharding; they keep the full-matrix path")
