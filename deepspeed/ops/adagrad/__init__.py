# compat: upstream import path deepspeed.ops.adagrad
"""Adagrad for ZeRO-Offload: :class:`DeepSpeedCPUAdagrad`."""

from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
