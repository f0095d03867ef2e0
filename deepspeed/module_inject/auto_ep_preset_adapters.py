"""Per-family AutoEP preset adapters, by name (DeepSpeed's module path; they live in the registry)."""

from __future__ import annotations

from .auto_ep_presets.base import AutoEPPresetAdapter, GroupRoutingConfig
from .auto_ep_presets.registry import get_preset_adapter

__all__ = ["AutoEPPresetAdapter", "GroupRoutingConfig", "get_preset_adapter"]
