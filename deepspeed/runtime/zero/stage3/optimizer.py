"""Stage3Optimizer: the optimizer side of ZeRO-3, over the shards a Stage3Coordinator owns.

The coordinator (coordinator.py) keeps, per gather unit, this rank's parameter slice
(`unit.shard`, parameters' dtype) and its fp32 gradient slice (`unit.grad_shard`, reduced and
averaged during backward, accumulated across micro-steps). This wrapper adds, per unit with
trained parameters, an fp32 master copy of the shard (on the shard's device, or on CPU with
`offload_optimizer`). As in ZeroOptimizer, the base torch optimizer sees one tensor per
parameter fragment of the master (`partition.fragments(rank)`), so per-group lr / weight decay
apply and its state is exactly this rank's 1/N. The step: unscale and overflow check, global
norm clipping (one all-reduce), base step, masters cast back into `unit.shard`, then
`coordinator.after_shard_update()` (persistent units re-gathered; the others pick the new
values up at their next gather). GatheredParameters(modifier_rank=...) also writes shards; each
master listens to its unit (`add_shard_listener`) and takes exactly the elements that changed.
"""

from __future__ import annotations

from typing import Any

import torch

from ....utils.timer import OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_STEP_TIMER, timed
from ...base_optimizer import ZeROOptimizer
from ...optimizer_wrapper import OptimizerWrapper
from ...precision.policy import PrecisionPolicy
from ..muon.sharded import ShardedMuon
from ..optimizer import MasterShard, PartitionedStateDict, attach_fragment_masters, step_on_shards
from .coordinator import Stage3Coordinator
from .sharded_param import ShardedUnit


class _UnitMaster(MasterShard):
    """One unit's fp32 master slice and the gradient slice the base optimizer reads."""

    def __init__(self, unit: ShardedUnit, master_dtype: torch.dtype, master_device: torch.device,
                 pin_memory: bool = False) -> None:
        self.unit = unit
        same = unit.shard_device == master_device and master_dtype == unit.grad_dtype
        # Offload elsewhere or another dtype: a master-side gradient copy, filled at each step.
        self._make_master(unit.shard, master_dtype, master_device, same, pin_memory)
        # Frozen parameters get no fragment (as at stages 1-2): the base optimizer never sees them.
        trainable = set(unit.trainable)
        self.fragments = [f for f in unit.partition.fragments(unit.rank) if f.index in trainable]
        self.params = unit.params
        self.partition = unit.partition
        self.fragment_masters: list[tuple[torch.Tensor, Any]] = []   # set by attach_fragment_masters
        self.pointed_grad: torch.Tensor | None = None
        unit.add_shard_listener(self._take_changed)   # GatheredParameters(modifier_rank=...) wrote the shard

    # The ranks the unit is partitioned over (an expert unit's: its expert-data-parallel group), for
    # safe_get_full_* (utils/tensor_fragment.py), which assembles a parameter over them.
    group = property(lambda self: self.unit.group)
    world = property(lambda self: self.unit.world)

    @property
    def grad_source(self) -> torch.Tensor:
        """The unit's reduced gradient slice (created at the first reduction after a step)."""
        return self.unit.grad_shard

    @property
    def grad(self) -> torch.Tensor:
        return self.grad_source if self._master_grad is None else self._master_grad

    def publish(self) -> None:
        """The updated master into the unit's shard ([Note: optimizer state swapping])."""
        self.unit.overwrite_shard(self.master)
        self.published = True

    def _take_changed(self, changed: torch.Tensor) -> None:
        """Copy the shard elements flagged in `changed` into the master (the others keep fp32)."""
        with self.resident(True):   # NVMe offload: the master is read in and written back
            changed = changed.to(self.master.device)
            self.master[changed] = self.unit.shard.to(self.master.device, self.master.dtype)[changed]


class Stage3Optimizer(PartitionedStateDict, OptimizerWrapper, ZeROOptimizer):
    """Wraps the base optimizer so it updates this rank's fp32 master shard of every ZeRO-3 unit."""

    fragment_layout = "units"  # read by deepspeed.utils.tensor_fragment

    def __init__(self, optimizer: torch.optim.Optimizer, coordinator: Stage3Coordinator, policy: PrecisionPolicy,
                 clip: float, names: dict[int, str], group: Any = None,
                 master_device: torch.device | None = None, pin_memory: bool = False) -> None:
        self._init_wrapper(optimizer, policy, clip, names, group)
        self.coordinator = coordinator
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owned = {id(p) for u in coordinator.units for p in u.params}
        strangers = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
        if strangers:
            raise ValueError(f"ZeRO-3: the optimizer trains parameters that are not the engine module's: {strangers}")
        if policy.master_dtype != torch.float32:   # low-precision masters: so are the gradient partitions
            for unit in coordinator.units:
                unit.set_grad_dtype(policy.grad_accum_dtype)
        self.units = [_UnitMaster(u, policy.master_dtype, master_device or u.shard.device, pin_memory)
                      for u in coordinator.units if any(id(p) in trained for p in u.params)]
        self._comm_device = coordinator.units[0].flat.device if coordinator.units else \
            ds_comm.collective_device(group)
        self._fragments_of, self.model_param_groups = attach_fragment_masters(optimizer, self.units, names)
        self.muon = ShardedMuon.maybe(optimizer, self.units, [list(um.unit.shapes) for um in self.units],
                                      self.model_param_groups, group, self._comm_device, names)
        if self.muon is not None and coordinator._param_groups:   # expert units live on other groups
            from ...errors import NotSupportedYet

            raise NotSupportedYet("the Muon optimizer with expert parallelism (ep_size > 1) at zero_optimization."
                                  "stage 3: not supported in this build; use ZeRO stage 1 or 2, or another optimizer")
        self._offload_view: Any = None
        self._fp32_view: Any = None   # _set_fp32_optimizer_param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.coordinator.zero_grad()

    def shard_numel(self) -> int:
        """Master elements held by this rank (ceil(unit/N) per trained unit, padding included)."""
        return sum(um.master.numel() for um in self.units)

    # --- the step ---------------------------------------------------------------------------
    def step(self, closure: Any = None) -> bool:
        self._refuse_step_if_offloaded()
        if self.coordinator.swapper is not None:   # a shard read or write failed on some rank: all raise
            self.coordinator.swapper.check("the optimizer step with offload_param.device nvme")
        with timed(self, OPTIMIZER_STEP_TIMER):   # wall_clock_breakdown (engine observer)
            applied = step_on_shards(self, self.units, "a ZeRO-3 gradient shard", self._comm_device)
        if not applied:
            return False
        with timed(self, OPTIMIZER_ALLGATHER_TIMER):   # shards updated; persistent units re-gathered
            self.refresh_from_masters()
        self.loss_scaler.update_scale(False)
        return True

    def refresh_from_masters(self) -> None:
        """Copy the fp32 masters into the units' shards (the model side), e.g. after a step or a
        checkpoint load; persistent units are re-gathered."""
        for um in self.units:
            if not um.published:   # NVMe offload published each unit during the step
                um.unit.overwrite_shard(um.master)   # casts to the parameters' dtype and device
            um.published = False
        self.coordinator.after_shard_update()

    @property
    def parameter_offload(self) -> Any:
        """Upstream's hook holder (``optimizer.parameter_offload``), which RL libraries use to
        unhook the model for generation: see zero/generation.py."""
        if self._offload_view is None:
            from ..generation import ParameterOffloadView

            self._offload_view = ParameterOffloadView(self.coordinator)
        return self._offload_view

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """Upstream's view of the reduced gradients after backward: [param group][index in the
        group] -> this rank's partition of that parameter's gradient in fp32, ceil(numel/N)
        elements (zero-padded at the end, as upstream's per-parameter partitions)."""
        where = {id(p): (um, i) for um in self.units for i, p in enumerate(um.params)}
        partitions: dict[int, dict[int, torch.Tensor]] = {}
        for g, params in enumerate(self.model_param_groups):
            partitions[g] = {}
            for i, p in enumerate(params):
                um, index = where[id(p)]
                piece = um.unit.layout.piece(um.grad_source, index)
                padded = torch.zeros(p.partition_numel(), dtype=torch.float32, device=piece.device)
                padded[:piece.numel()] = piece
                partitions[g][i] = padded
        return partitions

    def _set_fp32_optimizer_param_groups(self) -> None:
        """Upstream's: until `_clear_fp32_optimizer_param_groups()`, the base optimizer holds one fp32
        flat per param group (this rank's partition, the checkpoint layout) and its state keyed by
        them; see fp32_groups.py."""
        from .fp32_groups import Fp32GroupsView

        if self._fp32_view is None:
            self._fp32_view = Fp32GroupsView(self)

    def _clear_fp32_optimizer_param_groups(self) -> None:
        """Back to per-fragment params, taking over what changed in the flats and their state."""
        view, self._fp32_view = self._fp32_view, None
        if view is not None:
            view.remove()

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards (one per gather unit; upstream: one per param group),
        the tensors the step updates (upstream's attribute name; tests compare them)."""
        return [u.master for u in self.units]

    @property
    def fp16_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """This rank's parameter shards in the model's dtype, beside the masters above (upstream's name)."""
        return [u.unit.shard for u in self.units]

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """Upstream's per-sub-group gradient norms, which tests read between backward and step: here one,
        the global norm of the reduced gradient shards (each element once: dense units over the
        data-parallel group, expert units over their EDP group). Collective over the data-parallel group."""
        from .... import comm as ds_comm

        total = torch.zeros(1, dtype=torch.float32, device=self._comm_device)
        for um in self.units:
            if um.grad_source is not None:
                total += um.grad_source.float().pow(2).sum().to(self._comm_device)
        if self.dp_world > 1:
            ds_comm.all_reduce(total, group=self.group)
        return [total.sqrt().reshape(())]

    # upstream's attribute is a tensor (tests call torch.isfinite on it); stored as a float here
    _global_grad_norm = property(
        lambda self: None if self._norm_value is None else
        torch.tensor(self._norm_value, dtype=torch.float64),  # host: a scalar
        lambda self, value: setattr(self, "_norm_value", None if value is None else float(value)))

    def __repr__(self) -> str:
        return (f"Stage3Optimizer({type(self.optimizer).__name__}, units={len(self.units)}, "
                f"world={self.dp_world})")
