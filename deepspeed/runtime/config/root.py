"""RootConfig: the whole DeepSpeed JSON config as one pydantic model, and the policy for the
top-level keys it does not know.

[Note: unknown top-level keys]
Upstream reads the keys it knows and ignores the rest, so a typo such as `zero_optimisation`
silently trains without ZeRO. Here an unknown top-level key is an error when it is a near miss of
a known key or when it is a key of some section (`offload_optimizer` belongs under
`zero_optimization`). Any other unknown key is logged as a warning and ignored, so configs that
carry private keys still load; strict mode (`strict=True` or DS_STRICT_CONFIG=1) makes it an error.
Unknown keys inside sections are always errors (pydantic extra="forbid").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Iterator, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic_core import PydanticCustomError

from deepspeed.utils.logging import logger

from .errors import belongs_under, did_you_mean, format_validation_error, is_near_miss, show, suggest
from .sections.activation_checkpointing import ActivationCheckpointingConfig
from .sections.base import AUTO, DtypeName, Float, Int, Problem, key_homes
from .sections.checkpoint import CheckpointConfig
from .sections.comms import CommsLoggerConfig
from .sections.misc import AioConfig, FlopsProfilerConfig, TimersConfig
from .sections.monitor import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .sections.optimizer import OptimizerConfig, SchedulerConfig
from .sections.pipeline import PipelineConfig
from .sections.precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig, param_dtype_conflict
from .sections.expert_parallel import ExpertParallelConfig
from .sections.tensor_parallel import TensorParallelConfig
from .sections.unsupported import UNSUPPORTED_SECTIONS, UnsupportedSections
from .sections.zero import ZeroConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _steps_per_print(value: Any) -> Any:
    """Infinity (written by some configs to silence step logs) means "never", as does null."""
    if isinstance(value, float) and value == float("inf"):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1:
        raise PydanticCustomError("ds_expected", "expected an integer >= 1 (null or Infinity: never print)")
    return value


def _clipping(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise PydanticCustomError("ds_expected", "expected a number >= 0 (0 disables clipping)")
    return value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _allreduce_op(value: Any) -> Any:
    value = _lower(value)
    if value not in ("mean", "sum"):   # upstream's phrase, which callers match on
        raise ValueError(f"Invalid gradient_allreduce_op {value!r}: expected 'mean' or 'sum'")
    return value


def _log_level(value: Optional[str]) -> Optional[str]:
    if value is not None and value.lower() not in LOG_LEVELS:
        raise PydanticCustomError("ds_expected", "expected one of " + ", ".join(LOG_LEVELS))
    return value


class RootConfig(UnsupportedSections):
    """The whole config. Attribute names are the JSON keys; see docs/config.md.

    The sections this implementation does not provide come from UnsupportedSections.
    """

    train_batch_size: Optional[Int] = None
    """Samples per optimizer step over all data-parallel ranks (see batch.py)."""
    train_micro_batch_size_per_gpu: Optional[Int] = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Optional[Int] = None
    """Micro-batches accumulated per optimizer step."""
    managed_gradient_accumulation: bool = True
    """False: the caller owns the accumulation boundary and every step() updates."""
    steps_per_print: Annotated[Optional[Int], BeforeValidator(_steps_per_print)] = None
    """Log progress every N steps (None: never; 0.19.8's default)."""
    gradient_clipping: Annotated[Float, BeforeValidator(_clipping)] = 1.0
    """Clip the global gradient norm to this value (0 disables; 0.19.8 defaults to 1.0)."""
    communication_data_type: DtypeName = None
    """Dtype of gradient reduction ("fp32", "fp16", "bf16"; None: the parameters' dtype)."""
    seq_parallel_communication_data_type: DtypeName = "fp32"
    """Dtype of sequence-parallel gradient reduction."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before reduction instead of after."""
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    """Divide gradients by this factor before reduction and by world/factor after."""
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_allreduce_op)] = "mean"
    """Average ("mean") or add ("sum", not with ZeRO-3) gradients across data-parallel ranks."""
    disable_allgather: bool = False
    """Legacy switch kept for compatibility."""
    dump_state: bool = False
    """Print the engine state after initialisation."""
    disable_python_gc: bool = False
    """Disable Python's automatic cyclic garbage collector during training."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step (and the reduction and optimizer inside them); log the mean
    per optimizer step every steps_per_print steps."""
    memory_breakdown: bool = False
    """Log memory (device, RSS, model states by kind) before and after forward, backward and step."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch in deepspeed_io()."""
    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with a client optimizer DeepSpeed has not tested."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require DeepSpeed's CPU optimizer."""
    use_data_before_expert_parallelism: bool = False
    """MoE topology order (no effect without MoE layers)."""
    log_level: Annotated[Optional[str], AfterValidator(_log_level)] = None
    """Level of the deepspeed logger (debug, info, warning, error, critical)."""
    vocabulary_size: Optional[Int] = Field(None, ge=1)
    """Only used for a tensor-core alignment warning."""
    sequence_parallel_size: Int = Field(1, ge=1)
    """Ulysses sequence-parallel size (only 1 is supported here)."""
    allgather_size: Optional[Int] = Field(None, ge=0)
    """Legacy: allgather_bucket_size for the boolean `zero_optimization: true` form."""
    elasticity: Optional[dict[str, Any]] = None
    """Elastic batch sizes (deepspeed.elasticity checks the section and sets the batch triple)."""

    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision with loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision (legacy key: bfloat16)."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """torch.autocast around forward with fp32 parameters."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Gradient-accumulation, parameter and buffer dtypes."""
    optimizer: Optional[OptimizerConfig] = None
    """Optimizer the engine builds (None: the client passes one)."""
    scheduler: Optional[SchedulerConfig] = None
    """LR scheduler the engine builds (None: none or the client's)."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO sharding and offload."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """deepspeed.checkpointing settings."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline-engine settings."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint save/load settings."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Collective logging in deepspeed.comm."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler (one step, rank 0)."""
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """Throughput timer."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """NVMe async-I/O knobs (parsed; no effect here)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP tensor parallelism (autotp_size > 1 shards the model's Linear layers)."""
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """AutoEP: shard a Hugging Face MoE model's experts over autoep_size ranks (docs/moe.md)."""

    def _problems(self) -> Iterator[Problem]:
        """Rules across sections (sections check their own keys)."""
        if self.fp16.enabled and self.bf16.enabled:
            yield "bf16.enabled", "fp16 and bf16 are both enabled; enable at most one"
        if self.torch_autocast.enabled and (self.fp16.enabled or self.bf16.enabled):
            which = "fp16" if self.fp16.enabled else "bf16"
            yield "torch_autocast.enabled", (f"cannot be combined with {which}.enabled: torch_autocast keeps "
                                             f"fp32 parameters; use one or the other")
        conflict = param_dtype_conflict(self.data_types.param_dtype, self.fp16.enabled, self.bf16.enabled)
        if conflict:
            yield "data_types.param_dtype", conflict
        stage = self.zero_optimization.stage
        for key in ("fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
                    "bf16.bf16_optimizer_states"):
            section, name = key.split(".")
            if getattr(getattr(self, section), name) and stage == 0:
                yield key, "requires zero_optimization.stage 1, 2 or 3, got stage 0"
        if self.gradient_allreduce_op == "sum" and stage == 3:
            yield "gradient_allreduce_op", '"sum" is not supported with ZeRO stage 3 (zero_optimization.stage 3)'
        if self.vocabulary_size and self.vocabulary_size % 8:
            logger.warning(f"vocabulary_size {self.vocabulary_size} is not a multiple of 8 (tensor-core alignment)")


KNOWN_TOP_LEVEL = frozenset(RootConfig.model_fields) | {"bfloat16"}
# Sections with a default object: `"fp16": null` means "use the defaults", as an absent key does.
NULLABLE_SECTIONS = frozenset(k for k, f in RootConfig.model_fields.items() if f.default_factory is not None)
HOMES = key_homes(RootConfig)


@dataclass
class Prepared:
    """The user's dict made ready for RootConfig, and what was found on the way."""

    data: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    auto_paths: list[str] = field(default_factory=list)


def prepare(user: dict[str, Any], strict: bool) -> Prepared:
    """Apply legacy spellings, the unknown-key policy and "auto" dropping to a copy of `user`."""
    out = Prepared(data={})
    for key, value in user.items():
        if not isinstance(key, str):
            out.errors.append(f"{key!r}: config keys must be strings")
        elif key not in KNOWN_TOP_LEVEL:
            _unknown_top_level(key, strict, out)
        elif not (value is None and key in NULLABLE_SECTIONS | {"bfloat16"}):
            out.data[key] = value
    _legacy_spellings(out)
    out.data = _drop_auto(out.data, "", out)
    return out


def _unknown_top_level(key: str, strict: bool, out: Prepared) -> None:
    """See [Note: unknown top-level keys]."""
    near = [k for k in suggest(key, KNOWN_TOP_LEVEL) if is_near_miss(key, k)]
    homes = [h for h in HOMES.get(key, []) if h and h.split(".")[0] not in UNSUPPORTED_SECTIONS]
    if near or homes:
        out.errors.append(f"{key}: unknown top-level key{did_you_mean(near)}{belongs_under(homes)}")
        return
    hint = did_you_mean(suggest(key, KNOWN_TOP_LEVEL))
    if strict:
        out.errors.append(f"{key}: unknown top-level key{hint} (strict mode)")
    else:
        logger.warning(f"DeepSpeed config: unknown top-level key '{key}' is ignored{hint}. "
                       "Set DS_STRICT_CONFIG=1 (or strict=True) to make this an error.")


def _legacy_spellings(out: Prepared) -> None:
    data = out.data
    if "bfloat16" in data:
        legacy = data.pop("bfloat16")
        if "bf16" in data:
            out.errors.append("bfloat16: legacy spelling of bf16; give only bf16")
        elif legacy is not None:
            data["bf16"] = legacy
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):  # the pre-0.3 form `"zero_optimization": true`
        logger.warning('"zero_optimization": true/false is deprecated; use {"stage": N}')
        data["zero_optimization"] = {"stage": int(zero)}
        if zero and data.get("allgather_size") is not None:
            data["zero_optimization"]["allgather_bucket_size"] = data["allgather_size"]


def _drop_auto(value: Any, path: str, out: Prepared) -> Any:
    """Drop Hugging Face "auto" values (upstream does too) so the default applies; see docs."""
    if not isinstance(value, dict):
        return value
    kept: dict[str, Any] = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else str(key)
        if isinstance(item, str) and item == AUTO:
            if where in BATCH_KEYS:
                out.errors.append(f"{where}: got \"auto\"; batch sizes must be numbers by deepspeed.initialize "
                                  "(\"auto\" is filled in by the Hugging Face integration; give the value "
                                  "or leave the key out)")
            else:
                out.auto_paths.append(where)
            continue
        kept[key] = item if (not path and key in UNSUPPORTED_SECTIONS) else _drop_auto(item, where, out)
    return kept


def validate(prepared: Prepared) -> Optional[RootConfig]:
    """Build RootConfig from `prepared.data`, adding any errors to `prepared.errors`."""
    try:
        return RootConfig(**prepared.data)
    except ValidationError as exc:
        prepared.errors.extend(format_validation_error(exc, RootConfig, HOMES))
        return None


def log_auto_defaults(model: RootConfig, auto_paths: list[str]) -> None:
    for path in auto_paths:
        value: Any = model
        for part in path.split("."):
            value = getattr(value, part, None) if not isinstance(value, dict) else None
        if path.startswith(("optimizer.params.", "scheduler.params.")):
            logger.info(f'{path}: "auto" dropped; the constructor\'s default applies')
        elif value != AUTO:
            logger.info(f'{path}: "auto" left unresolved; using the default {show(value)}')

