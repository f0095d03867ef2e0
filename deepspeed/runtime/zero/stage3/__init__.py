"""ZeRO stage 3: parameters partitioned into gather units, gathered per module around forward
and backward, gradients reduce-scattered into each rank's shard. units.py plans (pure),
sharded_param.py owns the state, coordinator.py installs hooks, optimizer.py (Stage3Optimizer)
steps fp32 masters of the shards; the engine builds both (engine_setup.build_stage3_coordinator).
Before initialize, init_context.py (zero.Init) partitions parameters as modules are built;
gathered.py (GatheredParameters, external parameters) is the user API over both states;
watchdog.py bounds every unit collective in time and checks that ranks run the same schedule."""

from ..memory_estimators import (estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold,
                                 estimate_zero3_model_states_mem_needs_all_live)
from .coordinator import Stage3Coordinator
from .optimizer import Stage3Optimizer
from .sharded_param import ShardedUnit, ZeroParamStatus
from .units import UnitPlan, UnitSpec, plan_units
from .watchdog import ZeRO3DivergenceError

# compat: upstream's class name at upstream's path (deepspeed.runtime.zero.stage3); libraries check
# isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3). Build it through deepspeed.initialize.
DeepSpeedZeroOptimizer_Stage3 = Stage3Optimizer

__all__ = ["Stage3Coordinator", "Stage3Optimizer", "DeepSpeedZeroOptimizer_Stage3", "ShardedUnit", "ZeroParamStatus",
           "UnitPlan", "UnitSpec", "plan_units", "ZeRO3DivergenceError", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ...._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
