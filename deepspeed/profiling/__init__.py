# compat: upstream path `deepspeed.profiling` (the FLOPs profiler lives in flops_profiler/).
from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
