"""ZeRO stage 3: parameters partitioned into gather units, gathered per module around forward
and backward, gradients reduce-scattered into each rank's shard. units.py plans (pure),
sharded_param.py owns the state, coordinator.py installs hooks, optimizer.py (Stage3Optimizer)
steps fp32 masters of the shards; the engine builds both (engine_setup.build_stage3_coordinator)."""

from .coordinator import Stage3Coordinator
from .sharded_param import ShardedUnit, ZeroParamStatus
from .units import UnitPlan, UnitSpec, plan_units

__all__ = ["Stage3Coordinator", "ShardedUnit", "ZeroParamStatus", "UnitPlan", "UnitSpec", "plan_units"]
