# compat: upstream path `deepspeed.profiling.flops_profiler`.
from .profiler import (FlopsProfiler, bytes_to_string, duration_to_string, flops_to_string,  # noqa: F401
                       get_model_profile, macs_to_string, number_to_string, params_to_string)
