"""The `tensor_parallel` section: AutoTP training (docs/tensor_parallel.md)."""

from __future__ import annotations

from typing import Any, Iterator, Literal, Optional

from pydantic import Field

from .base import DSModel, Int, Problem, not_supported


class LayerSpecConfig(DSModel):
    """One rule of `partition_config.layer_specs`: the Linear layers whose "<module>.weight" a pattern
    matches (re.match) are split as `partition_type` says."""

    patterns: list[str] = Field(default_factory=list)
    """Regular expressions over parameter names ("model.layers.0.mlp.down_proj.weight")."""
    partition_type: Literal["column", "row", "skip", "COLUMN", "ROW", "SKIP"] = "column"
    """column: split the output features; row: split the input features (all-reduce of the output); skip: keep whole."""
    shape: Optional[Any] = None
    """Fused sub-parameters along the split dim: [3, -1] (equal q/k/v), [[q, k, v], -1], [2, -1] (gate/up)."""
    partition_dim: Optional[Int] = None
    """The weight dim to split: 0 for column, 1 for row (the only ones supported)."""
    model_types: Optional[list[str]] = None
    """Apply only to models whose config.model_type is one of these."""
    gather_output: bool = False
    """Column layers: all-gather the output features (Hugging Face's colwise_gather_output)."""
    grad_allreduce: bool = False
    """Accepted for upstream configs; replicated layers' gradients are already equal on every TP rank."""

    def _problems(self) -> Iterator[Problem]:
        from ....module_inject.autotp_config import TPLayerSpec

        try:   # one validation for the config and the plan ([Note: fused sub-parameters])
            TPLayerSpec(patterns=list(self.patterns), partition_type=self.partition_type, shape=self.shape,
                        partition_dim=self.partition_dim)
        except ValueError as e:
            key = next((k for k in ("shape", "partition_dim", "patterns") if str(e).startswith(k)), "shape")
            yield key, str(e)


class PartitionConfig(DSModel):
    use_default_specs: bool = True
    """With `preset_model`: apply the preset's specs after these."""
    layer_specs: list[LayerSpecConfig] = Field(default_factory=list)
    """The rules, first match wins; Linear layers no rule matches stay replicated."""
    strict_mode: bool = False
    """Upstream's: a Linear no rule matches is an error."""


class TensorParallelConfig(DSModel):
    """AutoTP: shard Linear layers over `autotp_size` ranks (tensor x data parallel with ZeRO 0-2)."""

    autotp_size: Int = Field(0, ge=0)
    """Tensor-parallel size; 0 or 1: off. The data-parallel size becomes world / autotp_size."""
    tp_overlap_comm: bool = False
    """Upstream's overlap of the row all-reduce; accepted, not overlapped here."""
    preset_model: Optional[str] = None
    """Built-in layer specs: llama, mistral, qwen2, qwen3, phi3."""
    partition_config: Optional[PartitionConfig] = None
    """Explicit layer specs (take precedence over the model's Hugging Face tp_plan)."""
    dtype: Optional[str] = None
    """Upstream's model dtype for tp_model_init; the engine's precision sections decide here."""
    keep_module_on_host: bool = False
    """Inference-loading knob; accepted, no effect in training."""
    injection_policy_tuple: Optional[Any] = None
    """Inference-only; accepted, no effect."""
    tp: Optional[dict[str, Any]] = Field(None, alias="tensor_parallel")
    """Upstream's inference sub-section; `tp_size` > 1 there is not supported."""

    def _problems(self) -> Iterator[Problem]:
        size = (self.tp or {}).get("tp_size", 1)
        if isinstance(size, int) and size > 1:
            yield "tp.tp_size", not_supported("inference tensor parallelism (tp.tp_size > 1)",
                                              "remove it or set it to 1 (autotp_size is the training switch)")
        if self.preset_model is not None:
            from ....module_inject.autotp_config import PRESETS

            if self.preset_model.lower() not in PRESETS:
                yield "preset_model", f"unknown preset {self.preset_model!r}; known: {sorted(PRESETS)}"
