"""MixedPrecisionOptimizer: master weights, loss-scale unscaling, overflow skip and clipping (stage 0).

The wrapped torch optimizer updates master tensors (fp32 copies of fp16/bf16 parameters, or
the parameters themselves under torch_autocast); their gradients are views of the engine's
gradient buckets. One `step()`:

1. unscale the buckets by the loss scale and look for inf/nan (one all-reduce of a flag, so
   every rank takes the same decision);
2. on overflow: skip the update, lower the scale, log the first parameter that overflowed;
3. else clip by the global norm, step the base optimizer, copy masters back into the model.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm as ds_comm
from ..optimizer_wrapper import OptimizerWrapper, clip_sharded_grads, counted_in_norm
from .policy import PrecisionPolicy


class MixedPrecisionOptimizer(OptimizerWrapper):
    """Wraps `optimizer` (built on the model's params) so that it updates master weights."""

    fragment_layout = "masters"  # read by deepspeed.utils.tensor_fragment

    def __init__(self, optimizer: torch.optim.Optimizer, grads: Any, policy: PrecisionPolicy, clip: float,
                 names: dict[int, str], group: Any = None) -> None:
        master_dtype = policy.master_dtype
        self._init_wrapper(optimizer, policy, clip, names, group)
        self.grads = grads
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (model param, master)
        self._grad_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master grad, bucket view)
        self.model_param_groups = [list(g["params"]) for g in optimizer.param_groups]  # checkpoint order
        for group_ in optimizer.param_groups:
            masters = []
            for p in group_["params"]:
                master = p if p.dtype == master_dtype else p.detach().to(master_dtype).clone()
                if master is not p:
                    master = torch.nn.Parameter(master, requires_grad=False)
                    self._pairs.append((p, master))
                view = grads.grad_view(p)
                if view.dtype == master.dtype:
                    master.grad = view
                else:  # e.g. data_types.grad_accum_dtype=bf16: copied up to the master dtype at step
                    master.grad = torch.zeros_like(master)
                    self._grad_copies.append((master.grad, view))
                masters.append(master)
                self._names.setdefault(id(master), names.get(id(p), "?"))
            group_["params"] = masters
        optimizer.state.clear()  # state was keyed by the model params it no longer sees
        self._model_param_of = {id(m): p for p, m in self._pairs}

    def master_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def fp32_groups(self) -> list[list[torch.Tensor]]:
        """The fp32 master weights per param group (upstream FP16_UnfusedOptimizer's attribute)."""
        return [list(g["params"]) for g in self.optimizer.param_groups]

    @property
    def fp32_groups_flat(self) -> list[torch.Tensor]:
        """The masters of each param group flattened into one tensor (upstream FP16_Optimizer's
        attribute; here a copy: our masters are one tensor per parameter)."""
        return [torch.cat([m.detach().reshape(-1) for m in group]) if group else torch.zeros(0)  # host: empty
                for group in self.fp32_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad()

    # --- the step ---------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        if self._grad_copies:
            torch._foreach_copy_([m for m, _ in self._grad_copies], [v for _, v in self._grad_copies])
        return [p.grad for p in self.master_params() if p.grad is not None]

    def _first_bad_parameter(self) -> str:
        for p in self.master_params():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return self._names.get(id(p), "?")
        return "(none on this rank)"

    def step(self, closure: Any = None) -> bool:
        """Returns True when the update was applied, False when skipped for overflow."""
        grads = self._master_grads()
        if self.tp_replicated is not None:   # [Note: TP-replicated gradients]
            self.tp_replicated.average([(m.grad, self._model_param_of.get(id(m), m), 0) for m in self.master_params()],
                                       ds_comm.collective_device(self.tp_replicated.group))
        self.overflow = self._found_overflow(grads)
        if self.overflow:
            return self._skip_step(self._first_bad_parameter())
        masters = [p for p in self.master_params() if p.grad is not None]
        if self.clip > 0.0 and self.split is not None:   # pipeline: the norm of the whole model
            counted = [counted_in_norm(self._model_param_of.get(id(m), m), self.split) for m in masters]
            self._global_grad_norm = clip_sharded_grads([m.grad for m in masters], self.clip, masters[0].device
                                                        if masters else None, None, 1, self.split,
                                                        counted)
        elif self.clip > 0.0 and masters:
            norm = torch.nn.utils.clip_grad_norm_(masters, max_norm=self.clip, foreach=True)
            self._global_grad_norm = float(norm)
        self.optimizer.step()
        if self._pairs:
            torch._foreach_copy_([p.data for p, _ in self._pairs], [m.data for _, m in self._pairs])
        self.loss_scaler.update_scale(False)
        return True

    def state_dict(self) -> dict:
        return {"optimizer_state_dict": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                "fp32_groups": [[m.detach().clone() for m in g["params"]] for g in self.optimizer.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for group_, saved in zip(self.optimizer.param_groups, state["fp32_groups"]):
            for master, value in zip(group_["params"], saved):
                master.data.copy_(value)
        if self._pairs:
            torch._foreach_copy_([p.data for p, _ in self._pairs], [m.data for _, m in self._pairs])

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, scaler={self.loss_scaler!r})"
