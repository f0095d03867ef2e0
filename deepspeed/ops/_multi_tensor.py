"""Shared plumbing for the multi-tensor optimizers in ``deepspeed.ops``.

Every optimizer here updates a whole param group with a handful of ``torch._foreach_*``
calls (or one fused torch kernel) instead of a Python loop over parameters. This module
gathers the tensors of one group into a :class:`Bucket` those calls can consume.

[Note: optimizer state dtype]
DeepSpeed's CPU optimizers keep fp32 moments by default even for bf16/fp16 parameters
(``fp32_optimizer_states=True``). Multi-tensor kernels want the param, grad and state of
one slot in a single dtype, so such a slot is updated on an fp32 *work copy* of the
param that is written back (rounded) after the kernel. That is what the upstream C++
kernels do internally, so results match them.

[Note: step counters]
``state["step"]`` is a float32 0-d tensor as in ``torch.optim`` (the fused kernels need
a tensor). It lives on the param's device when the fused kernel will run there and on
the CPU otherwise. Checkpoints written by upstream DeepSpeed store a plain ``int``;
:func:`step_tensor` converts those lazily so such checkpoints resume correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


def fused_adam_supported(device: torch.device) -> bool:
    """True when torch ships a fused (single-kernel) Adam for tensors on ``device``.

    CUDA has had one since torch 2.0, the CPU since 2.4; it is about 10x faster than the
    foreach path on CPU, which is why the CPU optimizers prefer it.
    """
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 4)
    return False


def step_tensor(state: dict, device: torch.device) -> torch.Tensor:
    """Return ``state["step"]`` as a float32 0-d tensor on ``device``. See [Note: step counters]."""
    step = state.get("step", 0)
    if not torch.is_tensor(step) or step.device != device or step.dtype != torch.float32:
        step = torch.as_tensor(float(step), dtype=torch.float32, device=device)
        state["step"] = step
    return step


def scalar(value) -> float:
    """A group hyper-parameter as a Python float (schedulers may store ``lr`` as a tensor)."""
    return value.item() if torch.is_tensor(value) else float(value)


@dataclass
class Bucket:
    """The tensors of one param group that a multi-tensor kernel updates in place.

    ``params[i]`` is either the parameter itself or an fp32 work copy of it (see
    [Note: optimizer state dtype]); call :meth:`write_back` after the kernel.
    """

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    _copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def state(self, key: str) -> list[torch.Tensor]:
        """The per-param state tensors stored under ``key``, in bucket order."""
        return [s[key] for s in self.states]

    def steps(self, device_of: Callable[[torch.Tensor], torch.device]) -> list[torch.Tensor]:
        """Step counters as tensors, each placed on ``device_of(param)``."""
        return [step_tensor(s, device_of(p)) for s, p in zip(self.states, self.params)]

    def write_back(self) -> None:
        """Copy updated work copies back into their (lower precision) parameters."""
        for param, work in self._copies:
            param.copy_(work)


def gather(
    optimizer: torch.optim.Optimizer,
    group: dict,
    init_state: Callable[[torch.Tensor], dict],
    sparse_ok: bool = False,
) -> Bucket:
    """Collect the params of ``group`` that have a gradient, creating state on first use.

    ``init_state(param)`` builds a fresh state dict; the dtype of its tensors is the
    compute dtype of that slot (see [Note: optimizer state dtype]). Sparse gradients are
    refused unless ``sparse_ok`` (then they are passed through uncast). Call under ``no_grad``.
    """
    bucket = Bucket()
    for param in group["params"]:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse and not sparse_ok:
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
        state = optimizer.state[param]
        if len(state) == 0:
            state.update(init_state(param))
        dtype = _state_dtype(state, param)
        target = param
        if param.dtype != dtype:
            target = param.to(dtype)
            bucket._copies.append((param, target))
        bucket.params.append(target)
        bucket.grads.append(grad if grad.dtype == dtype or grad.is_sparse else grad.to(dtype))
        bucket.states.append(state)
    return bucket


def _state_dtype(state: dict, param: torch.Tensor) -> torch.dtype:
    """The dtype of the slot's moment tensors (all share one), else the param's own."""
    for key, value in state.items():
        if key != "step" and torch.is_tensor(value):
            return value.dtype
    return param.dtype


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, load: Callable[[dict], None], state_dict: dict):
    """``load(state_dict)``, then put back the saved dtype of every state tensor.

    ``torch.optim.Optimizer.load_state_dict`` casts floating state to the *param's* dtype,
    which would silently round fp32 moments of bf16 params to bf16 on every resume
    (see [Note: optimizer state dtype]). We re-copy those tensors from ``state_dict``.
    """
    load(state_dict)
    saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, param in zip(saved_ids, params):
        for key, value in state_dict["state"].get(pid, {}).items():
            if key != "step" and torch.is_tensor(value) and value.dtype != param.dtype:
                optimizer.state[param][key] = value.detach().to(device=param.device, copy=True)


class ForeachOptimizer(torch.optim.Optimizer):
    """The step loop every optimizer here shares: gather a group's params that have a
    gradient into a :class:`Bucket`, update it with foreach/fused kernels, write it back.

    Subclasses give ``_init_state(param)`` (fresh state, see [Note: optimizer state dtype])
    and ``_update(bucket, group)`` (the math).
    """

    _sparse_ok = False  # whether sparse gradients are accepted (Adagrad)

    def _init_state(self, param: torch.Tensor) -> dict:
        raise NotImplementedError

    def _update(self, bucket: Bucket, group: dict) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like ``torch.optim``, but keep fp32 moments of low-precision params in fp32."""
        load_state_dict_keeping_dtypes(self, super().load_state_dict, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to every param that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            bucket = gather(self, group, self._init_state, sparse_ok=self._sparse_ok)
            if bucket.params:
                self._update(bucket, group)
                bucket.write_back()
        return loss


class FusedCompat:
    """Upstream ``Fused*`` surface: ``set_grad_none`` as the zero_grad default, and the
    deprecated step arguments (grads, output_params, ...) refused with upstream's message."""

    set_grad_none: bool

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        """One optimizer step. The extra arguments are upstream's deprecated ones and must be None."""
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError(
                f"{type(self).__name__} has been updated. Simply initialize it identically to torch.optim.Adam, "
                "and call step() with no arguments."
            )
        return super().step(closure)
