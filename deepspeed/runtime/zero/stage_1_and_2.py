# compat: upstream path deepspeed.runtime.zero.stage_1_and_2 (DeepSpeed 0.19.8 class name).
"""`DeepSpeedZeroOptimizer`: upstream's ZeRO stage 1/2 optimizer, here the sharding core.

Libraries import this name to recognise a ZeRO-wrapped optimizer (`isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)`); it is `ZeroOptimizer` itself (zero/optimizer.py), which the engine
builds for stages 1 and 2. Its constructor is this implementation's, not upstream's: build it
through `deepspeed.initialize`. Per-parameter access to its fp32 master weights, gradients and
optimizer state goes through `deepspeed.utils.safe_get_full_fp32_param` and friends.
"""

from .memory_estimators import (estimate_zero2_model_states_mem_needs, estimate_zero2_model_states_mem_needs_all_cold,
                                estimate_zero2_model_states_mem_needs_all_live)
from .optimizer import ZeroOptimizer

DeepSpeedZeroOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live"]
