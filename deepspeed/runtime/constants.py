# compat: upstream path deepspeed.runtime.constants (DeepSpeed 0.19.8 names).
"""Config key names and their defaults, as plain values (no pydantic: cheap to import).

The defaults agree with the typed config (deepspeed/runtime/config/root.py); a unit test checks
that they do. Upstream code reads configs with `param_dict.get(KEY, KEY_DEFAULT)`; the getters
in deepspeed.runtime.config.getters do the same.
"""

# --- routes of deepspeed_io -----------------------------------------------------------------
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"

# --- batch ----------------------------------------------------------------------------------
TRAIN_BATCH_SIZE, TRAIN_BATCH_SIZE_DEFAULT = "train_batch_size", None
TRAIN_MICRO_BATCH_SIZE_PER_GPU, TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = "train_micro_batch_size_per_gpu", None
GRADIENT_ACCUMULATION_STEPS, GRADIENT_ACCUMULATION_STEPS_DEFAULT = "gradient_accumulation_steps", None

# --- optimizer / scheduler ------------------------------------------------------------------
OPTIMIZER, OPTIMIZER_TYPE_DEFAULT, OPTIMIZER_PARAMS = "optimizer", None, "params"
TYPE, LEGACY_FUSION, LEGACY_FUSION_DEFAULT = "type", "legacy_fusion", False
SCHEDULER, SCHEDULER_TYPE_DEFAULT, SCHEDULER_PARAMS = "scheduler", None, "params"
MAX_GRAD_NORM = "max_grad_norm"
ZERO_ALLOW_UNTESTED_OPTIMIZER, ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = "zero_allow_untested_optimizer", False
ZERO_FORCE_DS_CPU_OPTIMIZER, ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = "zero_force_ds_cpu_optimizer", True

# Optimizer names matched case-insensitively in `optimizer.type` (deepspeed/runtime/optimizers.py).
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER = "muadam", "muadamw", "musgd"
LION_OPTIMIZER, MUON_OPTIMIZER = "lion", "muon"
ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER = "onebitadam", "zerooneadam", "onebitlamb"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]  # fmt: skip
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True

# --- logging and timing ---------------------------------------------------------------------
STEPS_PER_PRINT, STEPS_PER_PRINT_DEFAULT = "steps_per_print", None
LOG_LEVEL, LOG_LEVEL_DEFAULT = "log_level", None
WALL_CLOCK_BREAKDOWN, WALL_CLOCK_BREAKDOWN_DEFAULT = "wall_clock_breakdown", False
MEMORY_BREAKDOWN, MEMORY_BREAKDOWN_DEFAULT = "memory_breakdown", False
DUMP_STATE, DUMP_STATE_DEFAULT = "dump_state", False
DISABLE_ALLGATHER, DISABLE_ALLGATHER_DEFAULT = "disable_allgather", False
VOCABULARY_SIZE, VOCABULARY_SIZE_DEFAULT = "vocabulary_size", None

# --- gradients ------------------------------------------------------------------------------
GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT = "gradient_clipping", 1.0
PRESCALE_GRADIENTS, PRESCALE_GRADIENTS_DEFAULT = "prescale_gradients", False
GRADIENT_PREDIVIDE_FACTOR, GRADIENT_PREDIVIDE_FACTOR_DEFAULT = "gradient_predivide_factor", 1.0
COMMUNICATION_DATA_TYPE, COMMUNICATION_DATA_TYPE_DEFAULT = "communication_data_type", None
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE = "seq_parallel_communication_data_type"
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT = "fp32"
SPARSE_GRADIENTS, SPARSE_GRADIENTS_DEFAULT = "sparse_gradients", False
DATALOADER_DROP_LAST, DATALOADER_DROP_LAST_DEFAULT = "dataloader_drop_last", False
USE_DATA_BEFORE_EXPERT_PARALLEL, USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT = "use_data_before_expert_parallelism", False

# --- precision ------------------------------------------------------------------------------
FP16, BFLOAT16, BFLOAT16_OLD = "fp16", "bf16", "bfloat16"
DATA_TYPES, GRAD_ACCUM_DTYPE, GRAD_ACCUM_DTYPE_DEFAULT = "data_types", "grad_accum_dtype", None

# --- sections -------------------------------------------------------------------------------
ZERO_OPTIMIZATION = "zero_optimization"
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
PIPELINE = "pipeline"
CHECKPOINT = "checkpoint"
CHECKPOINT_TAG_VALIDATION, CHECKPOINT_TAG_VALIDATION_DEFAULT = "tag_validation", "WARN"
CHECKPOINT_TAG_VALIDATION_MODES = ["WARN", "IGNORE", "FAIL"]
LOAD_UNIVERSAL_CHECKPOINT, LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = "load_universal", False
USE_NODE_LOCAL_STORAGE_CHECKPOINT, USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = "use_node_local_storage", False


class ValidationMode:
    """`checkpoint.tag_validation` values."""

    WARN, IGNORE, FAIL = "WARN", "IGNORE", "FAIL"
