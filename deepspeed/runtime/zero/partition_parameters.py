# compat: upstream path deepspeed.runtime.zero.partition_parameters (DeepSpeed 0.19.8 names).
"""Upstream's ZeRO-3 parameter API at upstream's path: `Init` (stage3/init_context.py),
`GatheredParameters`, `register_external_parameter`, `unregister_external_parameter`
(stage3/gathered.py), `CUDAQuantizer` (ZeRO++'s weight quantiser, qwz.py) and `ZeroParamStatus`, which downstream code compares `param.ds_status`
against (published by ShardedUnit and, before initialize, by the zero.Init registry)."""

from ...accelerator import get_accelerator  # noqa: F401  (transformers reads pp.get_accelerator)
from .qwz import CUDAQuantizer
from .stage3.gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
from .stage3.init_context import Init
from .stage3.init_context import contradicting_single_rank_group as _contradicting_single_rank_pg_error  # noqa: F401
from .stage3.sharded_param import ZeroParamStatus
from .stage3.tensor_ctors import ORIGINALS as _ORIGINALS
from .stage3.tensor_ctors import zero_wrapper_for_fp_tensor_constructor  # noqa: F401

# The shape of a partitioned parameter's `.data` between gathers (ours: an empty placeholder).
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several asynchronous gather handles waited on as one (upstream groups its per-call handles
    this way; ours gathers whole units and has none of its own, but code that groups handles does)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


# Module globals that transformers patches or compares against while zero.Init is active; Init
# reads them from here when it installs its wrappers (see [Note: patchable constructor wrapper]).
_orig_torch_arange = _ORIGINALS["arange"]

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "CUDAQuantizer"]
