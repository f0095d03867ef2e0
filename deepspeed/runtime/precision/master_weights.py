"""Low-precision ZeRO master weights and gradients: the dtype choice and upstream's rules.

`fp16.fp16_master_weights_and_grads` / `bf16.bf16_master_weights_and_grads` keep each rank's
master partition and its gradient partition in fp16 / bf16 instead of fp32;
`bf16.bf16_optimizer_states` also keeps the optimizer moments in bf16 (docs/precision.md).

The rules are DeepSpeed 0.19.8's (its ZeRO optimizers' master-weight configuration), checked here
from the config (and the client optimizer when it is an instance) so that every rank raises the
same error before any collective:

* fp16 and bf16 masters are mutually exclusive;
* bf16 optimizer states need bf16 masters (a config error, runtime/config/root.py);
* whenever the optimizer states cannot stay on the device (fp16 masters; bf16 masters with fp32
  states; bf16 states with offload), ZeRO-Offload with `DeepSpeedCPUAdam` is required;
* bf16 states with offload need `DeepSpeedCPUAdam(fp32_optimizer_states=False)` (a config-built
  CPU Adam gets it: `build_optimizer` overrides the key, as upstream's engine does).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import NotSupportedYet, UsageError

FP16_KEY = "fp16.fp16_master_weights_and_grads"
BF16_KEY = "bf16.bf16_master_weights_and_grads"
STATES_KEY = "bf16.bf16_optimizer_states"
# ZeRO stages whose optimizer holds low-precision masters in this build
SUPPORTED_STAGES = (1, 2, 3)


def master_weights_dtype(model: Any) -> torch.dtype | None:
    """fp16 / bf16 when a low-precision master flag is set (the model config), else None (fp32)."""
    if model.fp16.fp16_master_weights_and_grads:
        return torch.float16
    if model.bf16.bf16_master_weights_and_grads:
        return torch.bfloat16
    return None


def _offload_device(model: Any) -> str | None:
    device = getattr(model.zero_optimization.offload_optimizer, "device", None)
    value = getattr(device, "value", device)
    return None if value in (None, "none") else value


def _config_optimizer_name(model: Any, offload: bool) -> str | None:
    """The class build_optimizer makes for the config's optimizer section (None: no section)."""
    section = model.optimizer
    if section is None:
        return None
    name = str(section.type).lower()
    if name in ("adam", "adamw") and not dict(section.params).get("torch_adam", False):
        return "DeepSpeedCPUAdam" if offload else "FusedAdam"
    return str(section.type)


def check_master_weights(config: Any, optimizer: Any = None) -> None:
    """Raise, on every rank alike, for a master-weight setting upstream refuses or this build does not run.
    `optimizer`: the client optimizer when it is an instance (a callable is checked once built,
    `check_built_optimizer`)."""
    model = config.model
    fp16, bf16, states = (model.fp16.fp16_master_weights_and_grads, model.bf16.bf16_master_weights_and_grads,
                          model.bf16.bf16_optimizer_states)
    if not (fp16 or bf16 or states):
        return
    if fp16 and bf16:
        raise UsageError("fp16_master_weights_and_gradients and bf16_master_weights_and_gradients are mutually "
                         f"exclusive ({FP16_KEY} and {BF16_KEY} are both true).")
    if states and not bf16:
        raise UsageError("bf16_optimizer_states requires bf16_master_weights_and_gradients.")
    key = FP16_KEY if fp16 else BF16_KEY
    stage = model.zero_optimization.stage
    if stage not in SUPPORTED_STAGES:   # stage 0 is a config error already (root.py)
        raise NotSupportedYet(f"{key}=true is not implemented yet at ZeRO stage {stage} in this build of deepspeed "
                              f"(low-precision master weights run at ZeRO stages "
                              f"{', '.join(map(str, SUPPORTED_STAGES))}); see docs/precision.md")
    section = "fp16" if fp16 else "bf16"
    if not getattr(model, section).enabled:
        raise NotSupportedYet(f"{key}=true needs {section}.enabled=true in this build of deepspeed (the model's "
                              f"parameters in {section}, the masters' dtype); see docs/precision.md")
    offload = _offload_device(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        name, instance = type(optimizer).__name__, optimizer
    elif optimizer is not None:   # a callable: checked once built (check_built_optimizer)
        return
    else:
        name, instance = _config_optimizer_name(model, offload == "cpu"), None
    if name is not None:   # no optimizer: no master weights
        _check_offload(model, stage, offload, name, instance)


def check_built_optimizer(config: Any, optimizer: torch.optim.Optimizer) -> None:
    """The same rules for an optimizer the client's callable built."""
    model = config.model
    if master_weights_dtype(model) is not None:
        _check_offload(model, model.zero_optimization.stage, _offload_device(model), type(optimizer).__name__,
                       optimizer)


def _check_offload(model: Any, stage: int, offload: str | None, name: str, optimizer: Any) -> None:
    fp16, states = model.fp16.fp16_master_weights_and_grads, model.bf16.bf16_optimizer_states
    offloaded = offload == "cpu" if stage < 3 else offload is not None
    if not fp16 and states and not offloaded:
        return   # bf16 masters and bf16 states stay on the device with any optimizer
    if not offloaded or name != "DeepSpeedCPUAdam":
        where = f"ZeRO-{stage} Offload" if stage < 3 else "ZeRO-3 Offload"
        raise UsageError(f"Master weights feature requires {where} with DeepSpeedCPUAdam. Current "
                         f"{'ZeRO-Offload' if stage < 3 else 'ZeRO-3 Offload'}:{offloaded} optimizer type {name} "
                         f"(set zero_optimization.offload_optimizer.device to \"cpu\" and use the Adam/AdamW "
                         f"optimizer section or DeepSpeedCPUAdam).")
    if states and optimizer is not None and getattr(optimizer, "fp32_optimizer_states", True):
        raise UsageError("bf16_optimizer_states with ZeRO-Offload requires DeepSpeedCPUAdam constructed "
                         "with fp32_optimizer_states=False so optimizer moments are stored in bf16.")
