# compat: upstream import path deepspeed.ops.adam
"""Adam optimizers: :class:`FusedAdam` (any device) and :class:`DeepSpeedCPUAdam` (ZeRO-Offload)."""

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
