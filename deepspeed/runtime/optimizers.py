"""Build the basic optimizer named by a DeepSpeed config's ``optimizer`` section.

This mirrors upstream ``DeepSpeedEngine._configure_basic_optimizer`` (0.19.8):

* ``Adam`` / ``AdamW``: ``torch_adam: true`` gives ``torch.optim.AdamW`` (or ``Adam``),
  ZeRO-Offload gives :class:`DeepSpeedCPUAdam`, anything else :class:`FusedAdam`.
  ``adam_w_mode`` defaults to True, so ``"Adam"`` means AdamW unless the config says
  ``"adam_w_mode": false``; ``"AdamW"`` always means AdamW.
* ``Lamb`` -> :class:`FusedLamb`; ``Lion`` -> :class:`FusedLion` (:class:`DeepSpeedCPULion`
  when offloading); ``Adagrad`` -> ``torch.optim.Adagrad`` (:class:`DeepSpeedCPUAdagrad`
  when offloading).
* ``MuAdam`` / ``MuAdamW`` / ``MuSGD`` come from the optional ``mup`` package.
* ``Muon`` -> :class:`deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam`, one Muon param
  group (the parameters tagged ``use_muon=True``) and one AdamW group (the others), as upstream
  (0.18.9+): ``muon_lr`` / ``adam_lr`` override ``lr`` for their half (see :func:`build_muon`).
* Any other name is looked up in ``torch.optim`` (e.g. ``SGD``, ``RMSprop``).

Unlike upstream, a misspelt type or parameter key is a ``ValueError`` that names the
config path (``optimizer.type`` / ``optimizer.params.<key>``) and what is accepted,
instead of a ``TypeError`` from deep inside a constructor.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Iterable

import torch

from .constants import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAM_W_MODE, ADAM_W_MODE_DEFAULT,  # noqa: F401
                        ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS, LAMB_OPTIMIZER, LION_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUON_OPTIMIZER, MUSGD_OPTIMIZER, TORCH_ADAM_PARAM)

# Names upstream once accepted (or still lists) that this build does not implement, with why.
_UNSUPPORTED = {
    "onebitadam": "1-bit optimizers were removed upstream and are not implemented here",
    "zerooneadam": "1-bit optimizers were removed upstream and are not implemented here",
    "onebitlamb": "1-bit optimizers were removed upstream and are not implemented here",
}
_MUP = {MUADAM_OPTIMIZER: "MuAdam", MUADAMW_OPTIMIZER: "MuAdamW", MUSGD_OPTIMIZER: "MuSGD"}
# Keys upstream consumes itself for Adam/AdamW before calling the optimizer's constructor.
_ADAM_EXTRA_KEYS = (ADAM_W_MODE, TORCH_ADAM_PARAM, "fp32_optimizer_states")


def torch_optimizer_names() -> list[str]:
    """Names of the optimizer classes in ``torch.optim`` (what other ``optimizer.type`` values may be)."""
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
    )


def supported_optimizer_names() -> list[str]:
    """Every accepted ``optimizer.type`` spelling, for error messages."""
    ds = ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "Muon", "MuAdam (needs mup)", "MuAdamW (needs mup)", "MuSGD (needs mup)"]
    shadowed = {ADAM_OPTIMIZER, ADAMW_OPTIMIZER, ADAGRAD_OPTIMIZER, MUON_OPTIMIZER, *_UNSUPPORTED}
    return ds + [name for name in torch_optimizer_names() if name.lower() not in shadowed]


def _type_error(type_name: str, why: str) -> ValueError:
    return ValueError(
        f"optimizer.type: got {type_name!r}; {why}. Supported (case-insensitive): "
        f"{', '.join(supported_optimizer_names())}"
    )


def _check_params(
    type_name: str, params: dict, target: Callable, extra: Iterable[str] = (), reserved: Iterable[str] = ()
) -> None:
    """Reject keys ``target`` cannot take, and missing required ones, naming the config path.

    ``extra`` are keys consumed before ``target`` is called (listed as accepted);
    ``reserved`` are constructor arguments the builder sets itself (not accepted).
    """
    signature = inspect.signature(target)
    names = [n for n in list(signature.parameters)[1:] if n not in reserved]  # [0] is params / model_params
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [n for n in names if signature.parameters[n].kind is not inspect.Parameter.VAR_KEYWORD]
    accepted += [k for k in extra if k not in accepted]
    for key in params:
        if key not in accepted and not takes_kwargs:
            raise ValueError(
                f"optimizer.params.{key}: not a parameter of optimizer type {type_name!r} "
                f"({_qualname(target)}); accepted keys: {', '.join(accepted)}"
            )
    for name in names:
        parameter = signature.parameters[name]
        required = parameter.default is inspect.Parameter.empty and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and name not in params:
            raise ValueError(f"optimizer.params.{name}: required by optimizer type {type_name!r}; add it")


def _qualname(target: Callable) -> str:
    return f"{target.__module__}.{target.__qualname__}"


def _build_adam(type_name: str, params: dict, model_parameters, on_cpu_offload: bool) -> torch.optim.Optimizer:
    """Adam/AdamW as upstream ``get_optimizer_configuration`` picks it."""
    params = dict(params)
    adam_w_mode = params.pop(ADAM_W_MODE, ADAM_W_MODE_DEFAULT)
    effective_w_mode = type_name.lower() == ADAMW_OPTIMIZER or bool(adam_w_mode)
    torch_adam = params.pop(TORCH_ADAM_PARAM, False)
    fp32_states = params.pop("fp32_optimizer_states", None)
    if torch_adam:
        cls = torch.optim.AdamW if effective_w_mode else torch.optim.Adam
        _check_params(type_name, params, cls)
        return cls(model_parameters, **params)
    if on_cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        _check_params(type_name, params, DeepSpeedCPUAdam, extra=_ADAM_EXTRA_KEYS, reserved=("adamw_mode",))
        fp32 = True if fp32_states is None else bool(fp32_states)
        return DeepSpeedCPUAdam(model_parameters, **params, adamw_mode=effective_w_mode, fp32_optimizer_states=fp32)
    from deepspeed.ops.adam import FusedAdam

    _check_params(type_name, params, FusedAdam, extra=_ADAM_EXTRA_KEYS)
    return FusedAdam(model_parameters, **params, adam_w_mode=effective_w_mode)


# upstream's engine reads these keys for each half (muon_lr / adam_lr override lr there)
_MUON_KEYS = ("lr", "momentum", "weight_decay", "muon_lr", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_lr")
_TAGGING_KEYS = ("per_head_muon",)   # read by set_optimizer_flags (per-parameter muon_num_heads), not a group key


def build_muon(params: dict, model_parameters: list) -> torch.optim.Optimizer:
    """``MuonWithAuxAdam`` over the parameters' ``use_muon`` tags (set by ``deepspeed.initialize``,
    see ``set_optimizer_flags``): group ``muon-params`` gets lr/muon_lr, momentum, weight_decay,
    ns_method; group ``adam-params`` lr/adam_lr, betas, eps, weight_decay. Param-group dicts are
    flattened (their options dropped), as upstream does."""
    from .zero.muon.muon_optimizer import MuonWithAuxAdam
    from .zero.muon.original_muon import check_ns_method

    for key in params:
        if key not in _MUON_KEYS + _ADAM_KEYS + _TAGGING_KEYS:
            accepted = ", ".join(dict.fromkeys(_MUON_KEYS + _ADAM_KEYS + _TAGGING_KEYS))
            raise ValueError(f"optimizer.params.{key}: not a parameter of optimizer type 'Muon'; accepted keys: "
                             f"{accepted}")
    if "ns_method" in params:
        check_ns_method(params["ns_method"], "optimizer.params.ns_method")
    flat = [p for item in model_parameters for p in (item["params"] if isinstance(item, dict) else [item])]
    untagged = [tuple(p.shape) for p in flat if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(f"optimizer.type 'Muon': {len(untagged)} parameter(s) (shapes {untagged[:4]}) have no "
                         "use_muon attribute; deepspeed.initialize tags the model's parameters, or set "
                         "param.use_muon = True (hidden matrices) / False (embeddings, heads, biases, norms)")
    groups = []
    for use_muon, keys, override, name in ((True, _MUON_KEYS, "muon_lr", "muon-params"),
                                           (False, _ADAM_KEYS, "adam_lr", "adam-params")):
        members = [p for p in flat if bool(p.use_muon) == use_muon and p.requires_grad]
        if members:
            options = {k: params[k] for k in keys if k in params and k != override}
            if override in params:
                options["lr"] = params[override]
            if "betas" in options:
                options["betas"] = tuple(options["betas"])
            groups.append(dict(params=members, use_muon=use_muon, name=name, **options))
    return MuonWithAuxAdam(groups)


def _resolve(name: str, type_name: str, on_cpu_offload: bool) -> Callable[..., torch.optim.Optimizer]:
    """The constructor for a non-Adam ``optimizer.type`` (lower-cased ``name``)."""
    if name == LAMB_OPTIMIZER:
        return importlib.import_module("deepspeed.ops.lamb").FusedLamb
    if name == LION_OPTIMIZER:
        module = importlib.import_module("deepspeed.ops.lion")
        return module.DeepSpeedCPULion if on_cpu_offload else module.FusedLion
    if name == ADAGRAD_OPTIMIZER:
        if on_cpu_offload:
            return importlib.import_module("deepspeed.ops.adagrad").DeepSpeedCPUAdagrad
        return torch.optim.Adagrad
    if name in _MUP:
        try:
            return getattr(importlib.import_module("mup"), _MUP[name])
        except ImportError:
            raise _type_error(type_name, f"{_MUP[name]} needs the 'mup' package (pip install mup)") from None
    if name in _UNSUPPORTED:
        raise _type_error(type_name, _UNSUPPORTED[name])
    by_lower = {n.lower(): n for n in torch_optimizer_names()}
    if name in by_lower:
        return getattr(torch.optim, by_lower[name])
    raise _type_error(type_name, "not a DeepSpeed optimizer nor a torch.optim optimizer")


def build_optimizer(
    type_name: str,
    params: dict[str, Any] | None,
    model_parameters,
    *,
    on_cpu_offload: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer for ``{"type": type_name, "params": params}``.

    Args:
        type_name: ``optimizer.type``, case-insensitive (``"Adam"``, ``"adamw"``, ``"SGD"``...).
        params: ``optimizer.params`` (not modified). Hyper-parameters of the chosen class,
            plus upstream's ``adam_w_mode`` / ``torch_adam`` / ``fp32_optimizer_states`` for Adam.
        model_parameters: an iterable of tensors or of param-group dicts; per-group options
            are kept.
        on_cpu_offload: ZeRO-Offload of the optimizer is on (upstream's
            ``zero_use_cpu_optimizer()``): pick the CPU implementations.

    Raises:
        ValueError: unknown/unimplemented type, or a key the optimizer does not take.
    """
    if not isinstance(type_name, str) or not type_name:
        raise _type_error(str(type_name), "expected a non-empty string")
    params = dict(params or {})
    if "max_grad_norm" in params:  # upstream refuses it for every type, before dispatching
        raise ValueError(
            "optimizer.params.max_grad_norm: not supported as an optimizer parameter; use the top-level "
            "'gradient_clipping' setting instead (https://www.deepspeed.ai/docs/config-json/#gradient-clipping)"
        )
    model_parameters = list(model_parameters)
    name = type_name.lower()
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        return _build_adam(type_name, params, model_parameters, on_cpu_offload)
    if name == MUON_OPTIMIZER:
        return build_muon(params, model_parameters)
    if ADAM_W_MODE in params or TORCH_ADAM_PARAM in params:
        key = ADAM_W_MODE if ADAM_W_MODE in params else TORCH_ADAM_PARAM
        raise ValueError(f"optimizer.params.{key}: only valid for optimizer type Adam/AdamW, got {type_name!r}")
    target = _resolve(name, type_name, on_cpu_offload)
    _check_params(type_name, params, target)
    return target(model_parameters, **params)
