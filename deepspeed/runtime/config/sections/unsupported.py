"""Top-level DeepSpeed sections this implementation does not provide.

Each is accepted while absent or disabled, so configs written for upstream keep loading, and is
rejected with a message naming the feature when it would change behaviour. What "enabled" means
differs per section; the table below says it for each. The section's other keys are not checked:
they have no effect here.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

from pydantic import AfterValidator, ValidationInfo
from pydantic_core import PydanticCustomError

from .base import DSModel, not_supported


def _flag(default: bool = False) -> Callable[[Any], bool]:
    """Enabled by an `enabled` key (or by the value itself when it is a bare boolean)."""

    def enabled(value: Any) -> bool:
        if value is None or isinstance(value, bool):
            return bool(value)
        if isinstance(value, dict):
            return bool(value.get("enabled", default))
        return True  # an unexpected type is not "disabled"

    return enabled


def _any_enabled(value: Any) -> bool:
    """Enabled if any nested block says enabled: true (compression_training has no top switch)."""
    if isinstance(value, dict):
        return bool(value.get("enabled") is True or any(_any_enabled(v) for v in value.values()))
    return value is True


def _key_true(key: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and bool(value.get(key, False))


def _present(value: Any) -> bool:
    """Enabled by being there at all, unless it says enabled: false."""
    return value is not None and value is not False and not (isinstance(value, dict) and value.get("enabled") is False)


_OFF = "remove it or set enabled: false"
# key -> (is it enabled?, feature name, how to turn it off)
UNSUPPORTED_SECTIONS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "autotuning": (_flag(), "autotuning", _OFF),
    "hybrid_engine": (_flag(), "the hybrid (RLHF) engine", _OFF),
    "data_efficiency": (_flag(), "data efficiency (curriculum sampling / random-LTD)", _OFF),
    "compile": (_key_true("deepcompile"), "DeepCompile", "remove it or set deepcompile: false"),
    "weight_quantization": (_flag(default=True), "weight quantization", _OFF),
    "datastates_ckpt": (_present, "DataStates checkpointing", "remove it"),
    "nebula": (_flag(), "Nebula checkpointing", _OFF),
    "compression_training": (_any_enabled, "the compression library", "remove it"),
    "amp": (_flag(), "NVIDIA Apex AMP", _OFF + " (use fp16, bf16 or torch_autocast)"),
    "quantize_training": (_flag(), "MoQ quantized training", _OFF),
    "eigenvalue": (_flag(), "eigenvalue computation", _OFF),
    "sparse_attention": (_present, "sparse attention", "remove it"),
    "graph_harvesting": (_flag(), "graph harvesting", "remove it or set it to false"),
    "curriculum_learning": (_flag(), "legacy curriculum learning", _OFF),
    "progressive_layer_drop": (_flag(), "progressive layer drop", _OFF),
    "sparse_gradients": (_flag(), "sparse gradient reduction", "remove it or set it to false"),
}


def _reject_if_enabled(value: Any, info: ValidationInfo) -> Any:
    enabled, what, fix = UNSUPPORTED_SECTIONS[str(info.field_name)]
    if enabled(value):
        raise PydanticCustomError("ds_unsupported", "{message}", {"message": not_supported(what, fix)})
    return value


Unsupported = Annotated[Any, AfterValidator(_reject_if_enabled)]
"""Any JSON value; an error when the section it holds is enabled."""


class UnsupportedSections(DSModel):
    """The top-level keys of UNSUPPORTED_SECTIONS; each is accepted while absent or off."""

    autotuning: Unsupported = None
    """Autotuning (not supported here)."""
    hybrid_engine: Unsupported = None
    """Hybrid RLHF engine (not supported here)."""
    data_efficiency: Unsupported = None
    """Curriculum data sampling / random-LTD (not supported here)."""
    compile: Unsupported = None
    """DeepCompile (not supported here)."""
    weight_quantization: Unsupported = None
    """Weight quantization (not supported here)."""
    datastates_ckpt: Unsupported = None
    """DataStates checkpointing (not supported here)."""
    nebula: Unsupported = None
    """Nebula checkpointing (removed upstream; not supported here)."""
    compression_training: Unsupported = None
    """Compression library (removed upstream; not supported here)."""
    amp: Unsupported = None
    """NVIDIA Apex AMP (removed upstream; use fp16, bf16 or torch_autocast)."""
    quantize_training: Unsupported = None
    """MoQ quantized training (removed upstream; not supported here)."""
    eigenvalue: Unsupported = None
    """Eigenvalue computation (removed upstream; not supported here)."""
    sparse_attention: Unsupported = None
    """Sparse attention (removed upstream; not supported here)."""
    graph_harvesting: Unsupported = None
    """Graph harvesting (removed upstream; not supported here)."""
    curriculum_learning: Unsupported = None
    """Legacy curriculum learning (removed upstream; not supported here)."""
    progressive_layer_drop: Unsupported = None
    """Progressive layer drop (removed upstream; not supported here)."""
    sparse_gradients: Unsupported = None
    """Sparse gradient reduction (removed upstream; not supported here)."""


if set(UnsupportedSections.model_fields) != set(UNSUPPORTED_SECTIONS):  # keep the table and the model in step
    raise RuntimeError("UnsupportedSections and UNSUPPORTED_SECTIONS list different keys")
