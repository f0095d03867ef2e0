# compat: upstream import path deepspeed.ops.lion
"""Lion optimizers: :class:`FusedLion` (any device) and :class:`DeepSpeedCPULion` (ZeRO-Offload)."""

from .lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
