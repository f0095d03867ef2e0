# compat: upstream path deepspeed.checkpoint.constants (DeepSpeed 0.19.8 names).
"""Keys and file-name parts of DeepSpeed's checkpoint layout that our writer and reader use
(deepspeed/runtime/checkpoint/writer.py, deepspeed/checkpoint/{files,reader,ds_to_universal}.py;
docs/checkpoint_format.md). Upstream names for layout parts we do not write are not defined here.
"""

# --- optimizer-states files (<prefix>zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt) ------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
LOSS_SCALER = "loss_scaler"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"

# --- model-states files (mp_rank_<mp>_model_states.pt) ------------------------------------------
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"
# The model's `universal_checkpoint_info` attribute (AutoTP's) in every model-states file, as upstream's
# engine writes it; Megatron-style trainers may pass their own under this key as client state (theirs wins).
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
# Keys inside that info (upstream's names). AutoTP attaches it to the model (module_inject/layers.py, [Universal-checkpoint info])
# and every model-states file records it; ds_to_universal and the TP re-slice read its affine maps.
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
SUB_PARAM_SHAPE = "sub_param_shape"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"   # {pattern: per sub-parameter, each rank's width}
# Each parameter's affine map (checkpoint/affine.py, [Note: affine maps]): {AFFINE_MAP_VERSION: 1,
# AFFINE_MAP_PARAMS: {name pattern: ParamAffineMap.to_dict()}}
AFFINE_MAP = "affine_map"
AFFINE_MAP_VERSION = "version"
AFFINE_MAP_PARAMS = "params"

# --- file names ---------------------------------------------------------------------------------
ZERO_FILE_PREFIX = "zero_pp_rank_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"

# --- universal checkpoints (<out>/zero/<param name>/<field>.pt, each {PARAM: tensor}) -----------
PARAM = "param"
FP32_WEIGHT_KEY = "fp32"
CAT_DIM = "cat_dim"
VOCAB_TENSOR = "vocab_tensor"   # a vocabulary tensor upstream's converter stripped of its padding
PARAM_N_SUB_PARAMS = "param_n_sub_params"   # equal sub-parameters along CAT_DIM (upstream's older fused form)
# A parameter's restore description (upstream's attribute name; checkpoint/universal_checkpoint.py)
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
EP_IS_EXPERT_PARAM = "is_expert_param"   # an AutoEP expert tensor: dim 0 over all experts
EP_NUM_EXPERTS = "ep_num_experts"
AUTOEP_LAYERS_KEY = "ds_autoep_layers"   # model states: each AutoEP layer's place and expert split
# ... at ZeRO-3 each entry marks upstream's partition-native layout (runtime/checkpoint/autoep_zero3_io.py)
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY = "checkpoint_format_version"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION = 1
AUTOEP_ZERO3_SOURCE_GROUP = "ds_optimizer_group"   # ours, in each saved param group: the optimizer group it came from

# --- EP x TP folding metadata (AutoEP with AutoTP; upstream's keys): a dict under FOLDING_METADATA_KEY
# in each model-states, expert and optimizer file of a folded checkpoint (checkpoint/autoep_universal.py)
FOLDING_METADATA_KEY = "folding"
EP_TP_LAYOUT_KEY = "ep_tp_layout"   # ours, in model states: the tensor and expert-parallel sizes that saved
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"

# --- the parallel layout that saved (model-states files; upstream's keys): {pp_degree, tp_degree}
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
