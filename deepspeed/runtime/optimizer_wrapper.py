"""The torch.optim.Optimizer-like surface shared by the engine's optimizer wrappers.

LR schedulers, users and frameworks read `param_groups`, `state`, `loss_scale` and call
`needs_scaler()` / `scale_if_loss()` (and seed 003's backward API, base_optimizer.py) on whatever
`engine.optimizer` is; the wrappers
(MixedPrecisionOptimizer at stage 0, ZeroOptimizer at stages 1-2) differ only in how they step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import math

import torch

from .. import comm as ds_comm
from ..utils.logging import log_dist
from .base_optimizer import EngineOptimizer
from .utils import is_model_parallel_parameter


@dataclass(frozen=True)
class SplitModel:
    """The model is split across ranks beyond data parallelism (pipeline stages, tensor slices):
    overflow flags and gradient norms are combined over `model_group` (the ranks holding the other
    parts of this replica) as well, and copies are left out of the norm so each parameter counts
    once: parameters marked `ds_pipe_replicated` (a tied weight's copies on later stages) and,
    under tensor parallelism, the replicated (unsharded) parameters on tensor ranks other than 0;
    under expert parallelism without ZeRO (`model_group` the expert-parallel group), the dense
    parameters on expert-parallel ranks other than 0 (engine_moe.py)."""

    model_group: Any
    tensor_rank: int = 0
    expert_rank: int = 0
    data_rank: int = 0   # `model_group` spans the data replicas too: dense parameters count on data rank 0
    expert_counted: Optional[bool] = None   # experts under tensor parallelism ([Note: EP x TP folding])
    experts_see_all_tokens: bool = False   # MoE's tensor-parallel experts: as dense parameters over the tensor group


def counted_in_norm(param: torch.Tensor, split: "SplitModel | None" = None) -> bool:
    if getattr(param, "ds_pipe_replicated", False):
        return False
    expert = hasattr(param, "allreduce") and not param.allreduce   # deepspeed.moe.utils.is_moe_param
    if split is not None and split.expert_counted is not None and expert:
        return split.expert_counted and (not split.experts_see_all_tokens or split.tensor_rank == 0 or
                                         is_model_parallel_parameter(param))
    if split is not None and split.data_rank != 0:
        return False
    if split is not None and split.expert_rank != 0:
        return expert
    if split is not None and split.tensor_rank != 0:   # AutoTP's or a Megatron-style layer's shard
        return is_model_parallel_parameter(param)
    return True


def clip_sharded_grads(grads: list[torch.Tensor], max_norm: float, comm_device: torch.device | None, group: Any,
                       world: int, split: Any = None, counted: list[bool] | None = None) -> float:
    """Clip gradient shards by the global norm over all ranks' shards, with one all-reduce;
    torch's clip_grad_norm_ formula. Returns the global norm. `comm_device` is where the
    all-reduce runs (the parameters' device, also when the shards are offloaded to CPU); None
    where this rank has no parameters to name it: the group's ([Note: collective device]).
    With `split` (a SplitModel) the sum also runs over the other parts of the model, and only
    the grads whose `counted` entry is true enter the norm (all are clipped)."""
    summed = grads if counted is None else \
        [g for g, keep in zip(grads, counted) if keep]
    if comm_device is None:
        comm_device = ds_comm.collective_device(group if world > 1 or split is None else split.model_group)
    local = torch.stack([g.float().pow(2).sum() for g in summed]).sum() if summed else \
        torch.zeros((), device=comm_device)
    total = local.reshape(1).to(comm_device)
    if world > 1:
        ds_comm.all_reduce(total, group=group)
    if split is not None:
        ds_comm.all_reduce(total, group=split.model_group)
    norm = math.sqrt(float(total))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm



class OptimizerWrapper(EngineOptimizer):
    """Delegates the optimizer surface to `self.optimizer` and the loss scale to `self.loss_scaler`."""

    optimizer: torch.optim.Optimizer
    loss_scaler: Any
    check_overflow: bool   # from PrecisionPolicy.check_overflow
    group: Any             # the data-parallel group
    overflow: bool
    _global_grad_norm: float | None
    optimizer_route: str | None = None   # the class upstream would have built (optimizer_routes.py)
    split: SplitModel | None = None      # set by the PipelineEngine
    tp_replicated: Any = None            # AutoTP: ReplicatedGradSync (runtime/tensor_parallel/replicated_grads.py)

    def _init_wrapper(self, optimizer: torch.optim.Optimizer, policy: Any, clip: float, names: dict[int, str],
                      group: Any) -> None:
        """The fields every wrapper sets the same way (the base optimizer, the scaler and overflow
        check of `policy`, clipping, the data-parallel group and its rank/size, parameter names)."""
        self.optimizer, self.loss_scaler, self.check_overflow = optimizer, policy.make_scaler(), policy.check_overflow
        self.clip, self.group, self._names = clip, group, names
        self.overflow = False
        self._global_grad_norm = None
        self.dp_rank, self.dp_world = ds_comm.get_rank(group), ds_comm.get_world_size(group)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    cur_scale = loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale moves (fp16 with loss_scale 0); upstream's attribute name."""
        return bool(self.loss_scaler.dynamic)

    @property
    def loss_scale_config(self) -> "_LossScaleView":
        """Upstream's newer name for the scaler's state (cur_scale, cur_iter, scale_window, ...)."""
        return _LossScaleView(self.loss_scaler)

    def needs_scaler(self) -> bool:
        """True when backward must scale the loss (fp16; seed 003's name)."""
        return self.loss_scaler.dynamic or self.loss_scaler.loss_scale != 1.0

    def scale_if_loss(self, value: Any) -> Any:
        """Scale `value` by the loss scale if it is a scalar tensor that can be backpropagated."""
        if torch.is_tensor(value) and value.numel() == 1 and value.requires_grad:
            return self.loss_scaler.scale(value)
        return value

    def _found_overflow(self, grads: list[torch.Tensor]) -> bool:
        """Unscale `grads` in place and decide, identically on every rank, whether any is inf/nan."""
        if not self.check_overflow:
            return False
        groups = [self.group] if ds_comm.get_world_size(self.group) > 1 else []
        if self.split is not None:
            groups.append(self.split.model_group)

        def reduce(flag: torch.Tensor) -> None:
            for group in groups:
                ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.MAX, group=group)

        return self.loss_scaler.unscale_and_check(grads, all_reduce=reduce if groups else None)

    def _skip_step(self, culprit: str) -> bool:
        """Overflow: lower the loss scale and skip this update (on every rank). Returns False."""
        scale = self.loss_scaler.loss_scale
        self.loss_scaler.update_scale(True)
        self._global_grad_norm = None
        log_dist(f"Overflow: gradients have inf/nan (first: {culprit}); skipping step, loss scale {scale} -> "
                 f"{self.loss_scaler.loss_scale}", ranks=[0], level=logging.WARNING)
        return False


class _LossScaleView:
    """Read-through view of a loss scaler under upstream's `loss_scale_config` names."""

    def __init__(self, scaler: Any) -> None:
        self._scaler = scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(self._scaler.dynamic)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scaler, name)
