# compat: upstream import path deepspeed.ops.lamb
"""LAMB optimizer: :class:`FusedLamb`."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
