"""Upstream's `deepspeed.runtime.tensor_parallel.config` path: the Hugging Face tp_plan reader."""

from __future__ import annotations

from typing import Any, Optional


def _get_hf_tp_plan(model: Any) -> Optional[dict[str, str]]:
    """The model's merged Hugging Face tp_plan (config's base_model_tp_plan, the class's and the
    instance's), keys relative to `model`; None when it has none. The plan AutoTP applies."""
    from ...module_inject.tp_plan import hf_tp_plan

    return hf_tp_plan(model) or None
