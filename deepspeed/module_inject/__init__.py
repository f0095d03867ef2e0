"""`deepspeed.module_inject`: AutoTP's tensor-parallel layers and the sharding of a model by them."""

from .layers import GatherReplacedLayerParams, LinearAllreduce, LinearLayer  # noqa: F401
