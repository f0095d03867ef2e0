"""AutoTP's layer specs at upstream's path (`deepspeed.module_inject.autotp_config`).

`TPLayerSpec` is one rule of `tensor_parallel.partition_config.layer_specs`; `AutoTPConfig` the list of
them. The plan (tp_plan.py) matches these; the config section validates the same fields through
`spec_from_dict`, so a bad spec gets one message wherever it comes from.

[Note: fused sub-parameters]
`shape` describes a fused weight as sub-parameters laid end to end along the split dim: `[3, -1]` is
three equal blocks (fused q/k/v), `[[q, k, v], -1]` three blocks of the given sizes (GQA), `[2, -1]`
gate and up. Each block is split over the TP ranks on its own, and a rank holds its piece of every
block, in block order, so the column layer's output on each rank is [q_r, k_r, v_r]: the model's
`split` of the fused output then still yields matching heads. Only 2-D weights split on the layer's
own dim (0 for column, 1 for row) are supported; other views (MoE's 3-D `shape`) are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class PartitionType(Enum):
    COLUMN = "column"   # split the output features
    ROW = "row"         # split the input features, all-reduce the output
    SKIP = "skip"       # keep whole


def _tuple(shape: Any) -> Any:
    return tuple(_tuple(s) for s in shape) if isinstance(shape, (list, tuple)) else shape


@dataclass
class TPLayerSpec:
    """Regexes over "<module>.weight" (re.match) and how the Linear layers they match are split."""

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[tuple] = None             # [Note: fused sub-parameters]
    partition_dim: Optional[int] = None       # default: 0 for column, 1 for row
    model_types: Optional[list[str]] = None   # apply only to these config.model_type values
    gather_output: bool = False               # column: all-gather the output features
    grad_allreduce: bool = False              # skip: Hugging Face's replicated_with_grad_allreduce

    def __post_init__(self) -> None:
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        if not isinstance(self.partition_type, PartitionType):
            try:
                self.partition_type = PartitionType(str(self.partition_type).lower())
            except ValueError:
                raise ValueError(f"partition_type={self.partition_type!r}: expected one of "
                                 f"{[p.value for p in PartitionType]}") from None
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"patterns: {p!r} is not a valid regular expression ({e})") from None
        if self.shape is not None:
            self.shape = _tuple(self.shape)
            self._validate_shape()
        want = 0 if self.partition_type == PartitionType.COLUMN else 1
        if self.partition_type != PartitionType.SKIP and self.partition_dim not in (None, want):
            raise ValueError(f"partition_dim={self.partition_dim!r}: a {self.partition_type.value} layer is split on "
                             f"dim {want} (the only one supported here)")

    def _validate_shape(self) -> None:
        shape, dim = self.shape, self.get_partition_dim()
        if not isinstance(shape, tuple) or not 0 <= dim < len(shape):
            raise ValueError(f"shape={shape!r}: expected a list with an entry at partition_dim={dim}")
        for i, d in enumerate(shape):
            if isinstance(d, tuple):
                if i != dim or not d or not all(isinstance(v, int) and not isinstance(v, tuple) and v > 0 for v in d):
                    raise ValueError(f"shape={shape!r}: a nested tuple only allowed at partition_dim={dim} (a list of "
                                     "sub-parameter sizes, positive ints, one level deep)")
            elif not isinstance(d, int) or isinstance(d, bool) or d == 0 or d < -1:
                raise ValueError(f"shape={shape!r}: dimensions must be positive ints or -1")
        if self.partition_type != PartitionType.SKIP:
            want = 0 if self.partition_type == PartitionType.COLUMN else 1
            if len(shape) != 2 or dim != want:
                raise ValueError(f"shape={shape!r} with partition_dim={dim}: only 2-D fused weights split on the "
                                 f"{self.partition_type.value} layer's dim {want} are supported")

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def has_unequal_sub_params(self) -> bool:
        return self.shape is not None and isinstance(self.shape[self.get_partition_dim()], tuple)

    def get_sub_param_sizes(self) -> Optional[tuple[int, ...]]:
        return self.shape[self.get_partition_dim()] if self.has_unequal_sub_params() else None

    def get_num_sub_params(self) -> Optional[int]:
        if self.shape is None:
            return None
        d = self.shape[self.get_partition_dim()]
        return len(d) if isinstance(d, tuple) else (d if d > 0 else None)

    def sub_sizes(self, total: int) -> Optional[tuple[int, ...]]:
        """The sub-parameter sizes along the split dim of a weight `total` wide (None: not fused)."""
        if self.shape is None or self.partition_type == PartitionType.SKIP:
            return None
        sizes = self.get_sub_param_sizes()
        if sizes is None:
            n = self.get_num_sub_params()
            if n is None:
                return None
            if total % n:
                raise ValueError(f"shape={self.shape!r}: dim {self.get_partition_dim()} of size {total} does not "
                                 f"divide into {n} equal sub-parameters")
            sizes = (total // n,) * n
        if sum(sizes) != total:
            raise ValueError(f"shape={self.shape!r}: sub-parameter sizes sum to {sum(sizes)}, the weight's dim "
                             f"{self.get_partition_dim()} is {total}")
        return tuple(sizes)

    def matches(self, param_name: str, model_type: Optional[str] = None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
                return False
        return any(re.match(p, param_name) for p in self.patterns)


def spec_from_dict(raw: dict, where: str = "layer_specs") -> TPLayerSpec:
    """A TPLayerSpec from its JSON form; errors name `where` (the config key)."""
    known = {"patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output", "grad_allreduce"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    try:
        return TPLayerSpec(**{k: v for k, v in raw.items() if v is not None or k in ("shape", "partition_dim")})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.{e}") from None


@dataclass
class AutoTPConfig:
    """The layer specs of one model; the first spec that matches a parameter name wins."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: Optional[str] = None) -> Optional[TPLayerSpec]:
        return next((s for s in self.layer_specs if s.matches(param_name, model_type)), None)

    @classmethod
    def from_dict(cls, config: dict) -> "AutoTPConfig":
        specs = [spec_from_dict(dict(s), f"layer_specs[{i}]") for i, s in enumerate(config.get("layer_specs") or [])]
        keep = {k: config[k] for k in ("tp_size", "embedding_partition_dim", "lm_head_patterns",
                                        "use_default_specs", "strict_mode") if k in config}
        return cls(layer_specs=specs, **keep)


_ROW_SPEC = {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"}
_LLAMA_LIKE = (_ROW_SPEC, {"patterns": [r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$"],
                           "partition_type": "column"})
PRESETS: dict[str, tuple[dict, ...]] = {name: _LLAMA_LIKE for name in ("llama", "mistral", "qwen2")}
# Qwen3's per-head q_norm/k_norm act on the column q/k_proj's heads: whole, gradient summed over TP (its tp_plan's
# replicated_with_grad_allreduce)
PRESETS["qwen3"] = _LLAMA_LIKE + ({"patterns": [r".*\.(q_norm|k_norm)\.weight$"], "partition_type": "skip",
                                   "grad_allreduce": True},)
# Phi-3: gate_up_proj is [gate; up] fused (split per block), down_proj row; the attention's fused qkv_proj
# has model-dependent q/k/v sizes, so attention stays whole (give `shape: [[q, k, v], -1]` to split it).
PRESETS["phi3"] = ({"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
                   {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1]},
                   {"patterns": [r".*\.(qkv_proj|o_proj)\.weight$"], "partition_type": "skip"})


class AutoTPPresets:
    """Built-in specs by model type (`tensor_parallel.preset_model`)."""

    @staticmethod
    def get_preset(model_type: str) -> Optional[AutoTPConfig]:
        specs = PRESETS.get(str(model_type).lower())
        if specs is None:
            return None
        return AutoTPConfig(layer_specs=[spec_from_dict(dict(s), f"preset {model_type}") for s in specs])

    @staticmethod
    def llama() -> AutoTPConfig:
        return AutoTPPresets.get_preset("llama")

    @staticmethod
    def qwen2() -> AutoTPConfig:
        return AutoTPPresets.get_preset("qwen2")

    @staticmethod
    def phi3() -> AutoTPConfig:
        return AutoTPPresets.get_preset("phi3")


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """`override`'s specs first, then `base`'s (when override.use_default_specs)."""
    specs = list(override.layer_specs) + (list(base.layer_specs) if override.use_default_specs else [])
    return AutoTPConfig(tp_size=override.tp_size, layer_specs=specs, use_default_specs=override.use_default_specs,
                        strict_mode=override.strict_mode)
