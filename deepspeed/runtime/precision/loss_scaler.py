"""Loss scalers: the sole owner of the fp16 loss scale and its update schedule.

    scaler = make_scaler(cfg.model.fp16); scaler.scale(loss).backward()
    overflow = scaler.unscale_and_check(grads, all_reduce=in_place_all_reduce)
    if not overflow: optimizer.step()
    scaler.update_scale(overflow)                 # only DynamicScaler moves the scale

[Note: dynamic loss scale schedule] DeepSpeed 0.19.8's `DynamicLossScaler.update_scale` (the
scaler of its ZeRO 1-3 optimizers). `cur_iter` counts every `update_scale` call.
  * Overflow: while hysteresis is left (`cur_hysteresis > 1`) only that counter drops. Otherwise
    the scale is divided by `scale_factor`, clamped at `min_scale`; lowering a scale that is already
    at `min_scale` raises instead (`raise_error_at_min_scale`). Then `last_overflow_iter = cur_iter`.
  * No overflow: `consecutive_hysteresis` refills hysteresis to `delayed_shift`. With
    `stable = cur_iter - last_overflow_iter - 1`, `stable > 0 and stable % scale_window == 0`
    multiplies the scale by `scale_factor` and refills hysteresis: the first raise comes on the
    (scale_window + 1)-th clean step after an overflow (or the start: `last_overflow_iter == -1`),
    then every `scale_window` clean steps.
0.19.8's non-ZeRO FP16_Optimizer ignores hysteresis and never raises:
`make_scaler(fp16, ignore_hysteresis=True)`. docs/precision.md works an example.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor

from deepspeed.utils.logging import log_dist

__all__ = ["BaseScaler", "DynamicScaler", "LossScaleAtMinimumError", "NoScaler", "StaticScaler", "make_scaler",
           "scaler_from_state_dict"]


class LossScaleAtMinimumError(RuntimeError, FloatingPointError):
    """Gradients keep overflowing at the minimum loss scale (upstream raises a bare Exception)."""


class BaseScaler:
    """A fixed loss scale; subclasses decide whether and how it moves. Attribute names are upstream's:
    ZeRO checkpoints pickle the scaler object, and the engine's `loss_scale` setter writes `cur_scale`."""

    dynamic = False
    _STATE_KEYS: tuple[str, ...] = ("cur_scale", "cur_iter")

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"fp16.loss_scale: got {scale}; a loss scale must be > 0")
        self.cur_scale = float(scale)
        self.cur_iter = 0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale(self, loss: Tensor) -> Tensor:
        """Multiply the loss so that small fp16 gradients do not flush to zero in backward."""
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    scale_loss = scale  # upstream name

    def update_scale(self, overflow: bool) -> None:
        """A fixed scale never changes; an overflow only means the caller skips this step."""
        if overflow:
            log_dist(f"[deepspeed] OVERFLOW! Skipping step {self.cur_iter}: gradients are non-finite "
                     f"(fixed loss scale {self.cur_scale}).", ranks=[0], level=logging.WARNING)
        self.cur_iter += 1

    def unscale_(self, grads: Iterable[Optional[Tensor]], found_inf: Optional[Tensor] = None) -> Tensor:
        """Divide `grads` in place by the scale; return `found_inf` (float32 [1], > 0 on inf/nan).

        Nothing syncs with the host here, so the caller can all-reduce `found_inf` with one
        collective before reading it. Pass `found_inf` on the communication device when this rank
        may hold no gradients, so that it still joins that collective.
        """
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for grad in grads:
            if grad is not None:
                groups[(grad.device, grad.dtype)].append(grad)
        if found_inf is None:
            device = next(iter(groups), (torch.device("cpu"), None))[0]  # host: no grads, no found_inf given
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        for (device, _), tensors in groups.items():
            local = found_inf if device == found_inf.device else torch.zeros(1, device=device)
            _unscale_group(tensors, local, 1.0 / self.cur_scale)
            if local is not found_inf:  # e.g. CPU-offloaded gradients
                found_inf.add_(local.to(found_inf.device))
        return found_inf

    def unscale_and_check(self, grads: Iterable[Optional[Tensor]],
                          all_reduce: Optional[Callable[[Tensor], Any]] = None,
                          found_inf: Optional[Tensor] = None) -> bool:
        """Unscale in place; True when any rank saw inf/nan. `all_reduce(found_inf)` (in place, SUM
        or MAX) is the one collective; the caller supplies it, so this module stays comm-free."""
        found_inf = self.unscale_(grads, found_inf)
        if all_reduce is not None:
            all_reduce(found_inf)
        return bool(found_inf.item() > 0)

    def state_dict(self) -> dict[str, Any]:
        """Upstream key names, plus `dynamic_loss_scale` as FP16_Optimizer stores it."""
        return {**{key: getattr(self, key) for key in self._STATE_KEYS}, "dynamic_loss_scale": self.dynamic}

    def load_state_dict(self, state: Any) -> None:
        """Load a `state_dict()`, an FP16_Optimizer state dict or an unpickled upstream scaler; keys
        the checkpoint lacks (FP16_Optimizer stores no hysteresis) keep their current values."""
        state = _as_mapping(state)
        saved_dynamic = bool(state.get("dynamic_loss_scale", state.get("dynamic", self.dynamic)))
        if saved_dynamic != self.dynamic:
            raise ValueError(f"checkpoint holds a {'dynamic' if saved_dynamic else 'static'} loss scaler but this run "
                             f"built {type(self).__name__} from fp16.loss_scale; use scaler_from_state_dict() to "
                             "resume with the checkpoint's kind")
        for key in self._STATE_KEYS:
            if key in state:
                setattr(self, key, state[key])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)}' for k in self._STATE_KEYS)})"


class NoScaler(BaseScaler):
    """bf16 / fp32: scale 1 forever; unscale_and_check still reports inf/nan (bf16 overflow check)."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def load_state_dict(self, state: Any) -> None:
        """Only the iteration count carries over: without fp16 there is no scale to restore."""
        self.cur_iter = _as_mapping(state).get("cur_iter", self.cur_iter)


class StaticScaler(BaseScaler):
    """`fp16.loss_scale > 0`: a fixed scale (upstream `LossScaler`)."""


class DynamicScaler(BaseScaler):
    """`fp16.loss_scale == 0`: follows [Note: dynamic loss scale schedule] at the top of this file."""

    dynamic = True
    _STATE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                   "delayed_shift", "cur_hysteresis", "consecutive_hysteresis")

    def __init__(self, init_scale: float = 2.0**16, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True) -> None:
        super().__init__(init_scale)
        _require(scale_factor > 1, "scale_factor", scale_factor, "> 1")
        _require(scale_window >= 1, "scale_window (fp16.loss_scale_window)", scale_window, ">= 1")
        _require(min_scale > 0, "min_scale (fp16.min_loss_scale)", min_scale, "> 0")
        _require(delayed_shift >= 1, "delayed_shift (fp16.hysteresis)", delayed_shift, ">= 1")
        self.last_overflow_iter = -1
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = min_scale
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        attempted = f"[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale}"
        if self.delayed_shift > 1 and self.cur_hysteresis > 1:
            log_dist(f"{attempted}, hysteresis {self.cur_hysteresis} -> {self.cur_hysteresis - 1}", ranks=[0])
            self.cur_hysteresis -= 1
            return
        if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleAtMinimumError(
                f"Current loss scale already at minimum - cannot decrease scale anymore: the fp16 loss scale is at "
                f"fp16.min_loss_scale ({self.min_scale}) and gradients keep overflowing (inf/nan), iteration "
                f"{self.cur_iter}. Try a lower learning rate or stronger gradient clipping, bf16 instead of fp16, "
                f"or check the data for inf/nan. DynamicScaler(raise_error_at_min_scale=False) skips such steps.")
        new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        log_dist(f"{attempted}, reducing to {new_scale}", ranks=[0])
        self.cur_scale = new_scale

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_steps = self.cur_iter - self.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor


def _unscale_group(grads: list[Tensor], found_inf: Tensor, inv_scale: float) -> None:
    """One fused kernel per (device, dtype) group; sparse gradients take a per-tensor path."""
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        inv = torch.full((1, ), inv_scale, dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(dense, found_inf, inv)
    for grad in grads:
        if grad.is_sparse:
            found_inf.add_((~torch.isfinite(grad._values())).any().to(found_inf.dtype))
            grad.mul_(inv_scale)


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"DynamicScaler {name}: got {value}; must be {rule}")


def _as_mapping(state: Any) -> Mapping[str, Any]:
    return state if isinstance(state, Mapping) else vars(state)


def make_scaler(fp16: Any, *, ignore_hysteresis: bool = False) -> BaseScaler:
    """The scaler for an `fp16` config section (None or disabled: NoScaler).

    `loss_scale == 0` selects dynamic scaling from 2**initial_scale_power with 0.19.8's ZeRO rules
    (hysteresis, error at min scale). `ignore_hysteresis=True` gives its non-ZeRO FP16_Optimizer
    rules instead: every overflow lowers the scale and none raises.
    """
    if fp16 is None or not fp16.enabled:
        return NoScaler()
    if fp16.loss_scale != 0:
        return StaticScaler(fp16.loss_scale)
    return DynamicScaler(init_scale=2.0**fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
                         min_scale=fp16.min_loss_scale, delayed_shift=1 if ignore_hysteresis else fp16.hysteresis,
                         consecutive_hysteresis=fp16.consecutive_hysteresis and not ignore_hysteresis,
                         raise_error_at_min_scale=not ignore_hysteresis)


def scaler_from_state_dict(state: Any, default: Optional[BaseScaler] = None) -> BaseScaler:
    """A scaler of the checkpoint's kind: upstream ZeRO replaces its scaler with the unpickled one.
    `default` (normally the config-built scaler) is reused when its kind matches the checkpoint. A
    NoScaler default is always kept: a run without fp16 has no scale to resume.
    """
    state = _as_mapping(state)
    dynamic = bool(state.get("dynamic_loss_scale", state.get("dynamic", False)))
    if default is not None and (default.dynamic == dynamic or isinstance(default, NoScaler)):
        scaler = default
    else:
        scaler = DynamicScaler(state["cur_scale"]) if dynamic else StaticScaler(state.get("cur_scale", 1.0))
    scaler.load_state_dict(state)
    return scaler
