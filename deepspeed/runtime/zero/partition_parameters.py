# compat: upstream path deepspeed.runtime.zero.partition_parameters (DeepSpeed 0.19.8 names).
"""`ZeroParamStatus`, which downstream code compares `param.ds_status` against. The status is
published by ShardedUnit (zero/stage3/sharded_param.py), the one owner of a ZeRO-3 parameter's state."""

from .stage3.sharded_param import ZeroParamStatus

__all__ = ["ZeroParamStatus"]
