"""`zero_optimization`: every key of DeepSpeed 0.19.8's DeepSpeedZeroConfig, same defaults.

Keys for features this implementation does not provide still parse; turning them on is an
error that names the feature (see [Note: config problems] in base.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator, Literal, Optional

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deepspeed.utils.logging import logger

from .base import DSModel, Int, Problem, not_supported, reject_bool
from .offload import OffloadOptimizerConfig, OffloadParamConfig

_MAXSIZE = 9_223_372_036_854_775_807  # sys.maxsize on 64-bit hosts, upstream's default below
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
DEFAULT_LEAF_MODULE_NAMES: tuple[str, ...] = ()
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: tuple[str, ...] = ()

# deprecated key -> (replacement key, value of the replacement or None to only warn)
_DEPRECATED = {
    "cpu_offload": ("offload_optimizer", lambda on: {"device": "cpu"} if on else None),
    "cpu_offload_param": ("offload_param", lambda on: {"device": "cpu"} if on else None),
    "cpu_offload_use_pin_memory": ("offload_param / offload_optimizer pin_memory", None),
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", lambda v: v),
}
_NEW_NAMES = {"stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save",)}


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


StrList = Annotated[list[str], BeforeValidator(_as_list)]


class LeafModuleConfig(DSModel):
    """`zero_optimization.leaf_module`: modules ZeRO-3 gathers as a unit (no hooks inside)."""

    classes: StrList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names (qualified or bare) treated as leaf modules."""
    names: StrList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    """Module names (as in named_modules()) treated as leaf modules."""
    name_suffixes: StrList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))
    """Module-name suffixes treated as leaf modules."""

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _dedupe(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class ZeroConfig(DSModel):
    """`zero_optimization`: which training state is sharded across data-parallel ranks."""

    stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(reject_bool)] = 0
    """0: off; 1: optimizer state; 2: + gradients; 3: + parameters (see zero/stages.py)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce."""
    reduce_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements reduced per bucket."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the reduce buckets of several ranks into one all-reduce."""
    allgather_partitions: bool = True
    """All-gather updated parameters (instead of a series of broadcasts)."""
    allgather_bucket_size: Int = Field(500_000_000, ge=0)
    """Elements all-gathered per bucket."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with backward; unset means True for stage 3, else False."""
    compute_grad_norm: bool = True
    """Compute the global gradient norm in stage 1/2 steps (false only for stages 1 and 2)."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the checkpoint's fp32 copies."""
    elastic_checkpoint: bool = False
    """Legacy elastic checkpointing (upstream no longer supports it for stage 3)."""
    offload_param: Optional[OffloadParamConfig] = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer-state offload (stages 1-3)."""
    zenflow: Optional[dict[str, Any]] = None
    """ZenFlow settings (not supported here)."""
    sub_group_size: Int = Field(1_000_000_000, ge=0)
    """Elements per optimizer sub-group (tile) in stage 3."""
    prefetch_bucket_size: Int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: parameter elements fetched ahead of use."""
    param_persistence_threshold: Int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements stay unpartitioned."""
    model_persistence_threshold: Int = Field(_MAXSIZE, ge=0, alias="stage3_model_persistence_threshold")
    """Stage 3: cap on the total elements kept unpartitioned."""
    max_live_parameters: Int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    """Stage 3: parameter elements resident per rank before releasing."""
    max_reuse_distance: Int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a parameter gathered if it is reused within this many elements."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: gather full 16-bit weights in save_16bit_model()."""
    module_granularity_threshold: Int = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    """Stage 3: fetch modules finer than this granularity as one unit."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Stage 3: fetch parameters with all-reduce instead of all-gather."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Stage 3: all-gather parameters one by one instead of in buckets."""
    ignore_unused_parameters: bool = True
    """Do not fail when some parameters get no gradient."""
    legacy_stage1: bool = False
    """Upstream's retired stage-1 implementation switch (no effect)."""
    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: spread gradient copies over ranks."""
    parameter_alignment: bool = False
    """Stage 1/2: pad flat buffers so each parameter starts 16-byte aligned."""
    zero_hpz_partition_size: Int = Field(1, ge=0)
    """ZeRO++ hpZ: ranks per node of the secondary parameter partition (stage 3, zero/stage3/hpz.py;
    below stage 3 it has no effect and a warning says so, as upstream ignores it there)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: int8 block-wise stage-3 parameter all-gathers (zero/qwz.py)."""
    zero_quantized_nontrainable_weights: bool = False
    """Store frozen weights quantized (not supported here)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: int8 block-wise stage-3 gradient reduce-scatter (zero/qgz.py)."""
    memory_efficient_linear: bool = True
    """Stage 3: memory-efficient linear autograd function."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: force checkpoint loading in pipeline mode."""
    override_module_apply: bool = True
    """Stage 3: gather parameters around nn.Module.apply."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log prefetch trace-cache invalidations."""
    enable_sanity_checks: bool = False
    """Run internal consistency checks (debugging)."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Muon + NVMe: keep the momentum buffer in memory."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """ZeRO-3 leaf modules."""
    mics_shard_size: Int = -1
    """MiCS shard size (removed upstream in 0.19.8; not supported)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS hierarchical all-gather (removed upstream in 0.19.8; not supported)."""
    zeropp_loco_param: Optional[dict[str, Any]] = None
    """LoCo-ZeRO++ settings (removed upstream in 0.19.8; not supported)."""

    @model_validator(mode="before")
    @classmethod
    def _migrate_deprecated(cls, data: Any) -> Any:
        """Rewrite upstream's deprecated keys onto their replacements, warning once per key."""
        if not isinstance(data, dict) or not any(k in data for k in _DEPRECATED):
            return data
        data, problems = dict(data), []
        for old, (new, convert) in _DEPRECATED.items():
            if old not in data:
                continue
            value = data.pop(old)
            logger.warning(f"zero_optimization.{old} is deprecated; use {new} instead")
            if convert is None:
                continue
            if any(n in data for n in (new, *_NEW_NAMES.get(new, ()))):
                problems.append((old, f"deprecated alias of {new}; give only {new}"))
            elif convert(value) is not None:
                data[new] = convert(value)
        if problems:
            summary = "; ".join(f"{k}: {m}" for k, m in problems)
            raise PydanticCustomError("ds_problems", "{summary}", {"summary": summary, "problems": problems})
        return data

    @model_validator(mode="after")
    def _resolve_overlap_comm(self) -> "ZeroConfig":
        if self.overlap_comm is None:  # upstream's stage-dependent default
            self.__dict__["overlap_comm"] = self.stage == 3
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning("zero_optimization.elastic_checkpoint: elastic checkpointing is deprecated and has no "
                           "effect with stage 3 (checkpoints load at any world size and stage without it)")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:   # upstream ignores it below stage 3 too
            logger.warning(f"zero_optimization.zero_hpz_partition_size={self.zero_hpz_partition_size} has no effect "
                           f"with stage {self.stage}: hpZ partitions stage 3's parameters")
        return self

    def _problems(self) -> Iterator[Problem]:
        if not self.compute_grad_norm and self.stage not in (1, 2):
            yield "compute_grad_norm", f"false is supported only with stage 1 or 2, got stage {self.stage}"
        if self.offload_param is not None and self.offload_param.enabled and self.stage != 3:
            yield "offload_param", f"parameter offload needs stage 3, got stage {self.stage}"
        if self.offload_optimizer is not None and self.offload_optimizer.enabled and self.stage == 0:
            yield "offload_optimizer", "optimizer offload needs stage 1, 2 or 3, got stage 0"
        if self.zero_quantized_gradients and self.stage != 3:   # qgZ replaces stage 3's reduce-scatter
            yield "zero_quantized_gradients", f"true needs stage 3, got stage {self.stage}"
        if self.zero_quantized_weights and self.stage != 3:     # qwZ replaces stage 3's parameter all-gather
            yield "zero_quantized_weights", f"true needs stage 3, got stage {self.stage}"
        if self.stage in (1, 2) and self.allgather_bucket_size % 2:   # upstream's rule: portable configs
            yield "allgather_bucket_size", ("allgather_bucket_size must be a multiple of nccl_start_alignment_factor "
                                            f"(2), got {self.allgather_bucket_size}")
        yield from self._unsupported()

    def _unsupported(self) -> Iterator[Problem]:
        checks = [
            ("zenflow", self.zenflow is not None, "ZenFlow", "remove it"),
            ("mics_shard_size", self.mics_shard_size > 0, "MiCS sharding", "remove it"),
            ("mics_hierarchical_params_gather", self.mics_hierarchical_params_gather, "MiCS", "remove it"),
            ("zeropp_loco_param", self.zeropp_loco_param is not None, "LoCo-ZeRO++", "remove it"),
        ]
        checks += [(key, getattr(self, key), f"ZeRO++ {key}", "set it to false") for key in
                   ("zero_quantized_nontrainable_weights",)]
        for key, enabled, what, fix in checks:
            if enabled:
                yield key, not_supported(what, fix)

    # Upstream JSON spellings of the aliased fields, readable as attributes too.
    stage3_prefetch_bucket_size = property(lambda self: self.prefetch_bucket_size)
    stage3_param_persistence_threshold = property(lambda self: self.param_persistence_threshold)
    stage3_model_persistence_threshold = property(lambda self: self.model_persistence_threshold)
    stage3_max_live_parameters = property(lambda self: self.max_live_parameters)
    stage3_max_reuse_distance = property(lambda self: self.max_reuse_distance)
    stage3_gather_16bit_weights_on_model_save = property(lambda self: self.gather_16bit_weights_on_model_save)
    stage3_module_granularity_threshold = property(lambda self: self.module_granularity_threshold)
    stage3_use_all_reduce_for_fetch_params = property(lambda self: self.use_all_reduce_for_fetch_params)
    stage3_allgather_sequential = property(lambda self: self.allgather_sequential)


# Upstream class names.
DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroLeafModuleConfig = LeafModuleConfig
