# compat: upstream import path deepspeed.ops.lamb
"""LAMB optimizer: :class:`FusedLamb`."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

# compat: `deepspeed.<pkg>.<submodule>` chains resolve after `import deepspeed` (upstream imports eagerly).
from ..._lazy import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)
