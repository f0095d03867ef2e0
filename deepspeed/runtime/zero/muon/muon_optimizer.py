"""`MuonWithAuxAdam`: Muon for the param groups tagged `use_muon=True`, AdamW for the others.

Upstream's class at upstream's path, built by `"optimizer": {"type": "Muon"}` (runtime/optimizers.py)
or by the client. Group keys as upstream's, with its defaults: Muon groups `lr` 0.02, `momentum`
0.95, `weight_decay` 0, `ns_method` "gram"; Adam groups `lr` 3e-4, `betas` (0.9, 0.95), `eps`
1e-10, `weight_decay` 0. Math: [Note: Muon semantics] in original_muon.py.

Without ZeRO every Muon parameter is a whole matrix and `step()` orthogonalises it here. Under
ZeRO 1-3 the parameters this optimizer sees are 1-D fragments of fp32 master shards; the ZeRO
optimizer then runs `ShardedMuon` (sharded.py), which calls `momentum_step` on each fragment,
gathers each matrix to one owner rank for `orthogonalize`, and hands the result back as the
fragment's gradient inside `directions_given()`, where `step()` only applies it. The momentum
buffer (`state[p]["momentum_buffer"]`, one fp32 per element of p) is the only Muon state.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .original_muon import adam_direction, check_ns_method, momentum_direction
from .tensor_parallel import orthogonalize_param

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
# the per-element state each kind of group keeps (what a checkpoint load restores for it)
MUON_STATE = ("momentum_buffer",)
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon on the `use_muon=True` param groups, AdamW on the rest (`use_muon` is required)."""

    def __init__(self, param_groups: Any) -> None:
        groups = [dict(g) for g in param_groups]
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or "use_muon" not in group:
                raise ValueError(f"MuonWithAuxAdam: param group {i} has no 'use_muon' key; pass param groups "
                                 "dict(params=..., use_muon=True|False)")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            for key, value in defaults.items():
                group.setdefault(key, value)
            if group["use_muon"]:
                check_ns_method(group["ns_method"], f"MuonWithAuxAdam param group {i}: ns_method")
        super().__init__(groups, {})
        self._given = False

    @contextmanager
    def directions_given(self) -> Iterator[None]:
        """Within it, the `.grad` of each Muon parameter is its final (orthogonalised) direction:
        `step()` applies it with weight decay and lr and computes nothing (ZeRO's sharded step)."""
        self._given = True
        try:
            yield
        finally:
            self._given = False

    def momentum_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """Advance `p`'s momentum with `grad` and return the Nesterov direction (elementwise)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        return momentum_direction(grad, state["momentum_buffer"], group["momentum"])

    @staticmethod
    def state_fields(group: dict) -> tuple[str, ...]:
        """The state entries a parameter of `group` keeps."""
        return MUON_STATE if group.get("use_muon") else ADAM_STATE

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if group["use_muon"]:
                    update = grad if self._given else self._whole_matrix_update(p, grad, group)
                else:
                    update = self._adam_update(p, grad, group)
                p.mul_(1 - lr * wd)
                p.add_(update.reshape(p.shape), alpha=-lr)
        return loss

    def _whole_matrix_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        if p.dim() < 2:
            raise ValueError(f"MuonWithAuxAdam: a use_muon=True parameter must be a matrix (ndim >= 2), got shape "
                             f"{tuple(p.shape)}; tag it param.use_muon = False")
        direction = self.momentum_step(p, grad, group)
        return orthogonalize_param(p, direction, p.shape, group["ns_method"]).to(p.dtype)

    def _adam_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = torch.tensor(0.0)  # host: torch.optim's step counter
        state["step"] += 1
        return adam_direction(grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
                              group["betas"], group["eps"])
