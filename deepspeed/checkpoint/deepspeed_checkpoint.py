# compat: upstream path deepspeed.checkpoint.deepspeed_checkpoint (DeepSpeed 0.19.8 names).
"""`DeepSpeedCheckpoint`: the inspection API Megatron-DeepSpeed's conversion tools use on a checkpoint
tag folder: its (pp, tp, dp) degrees, its files per rank of a target layout and the few global values
(iteration, args, universal-checkpoint info) of its model-states files.

Each model-states file is loaded once, at construction; only small metadata is kept (the recorded
layout, parameter shapes, AutoEP layers, the expert-ordering setting), plus the first file's globals,
so that a tool walking a large checkpoint does not hold every file's weights.
"""

from __future__ import annotations

import os
import re

from .constants import AUTOEP_LAYERS_KEY, CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, \
    PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO
from .reshape_3d_utils import LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, get_files, get_files_with_prefix, \
    get_model_3d_descriptor_from_metadata, get_zero_files, load_model_states, meg_2d_parallel_map, model_3d_desc, \
    partition_data, reshape_meg_2d_parallel
from .zero_checkpoint import ZeROCheckpoint, basic_folder_validation

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts",
                          "ep_size")
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")


def _kind(value):
    """A malformed value is kept as its type's name, so the consumer's check still names what it found."""
    return value if value is None else type(value).__name__


def _small_metadata(state: dict) -> dict:
    """What the descriptor and ds_to_universal need of one model-states file."""
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict):
        dims = {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    else:
        dims = _kind(dims)
    shapes = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(group, dict) for group in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    else:
        shapes = _kind(shapes)
    autoep = state.get(AUTOEP_LAYERS_KEY, state.get(AUTOEP_LAYERS_KEY_LEGACY))
    if isinstance(autoep, list):
        autoep = [{k: v for k, v in entry.items() if k in AUTOEP_METADATA_FIELDS} if isinstance(entry, dict)
                  else type(entry).__name__ for entry in autoep]
    else:
        autoep = _kind(autoep)
    config = state.get("ds_config", {})
    if isinstance(config, dict):
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        config = {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else _kind(ordering)}
    else:
        config = _kind(config)
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: autoep, "ds_config": config}


class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint tag folder seen at its own layout or at a smaller (tp, pp, dp) one."""

    def __init__(self, dir: str, tp_degree: int | None = None, pp_degree: int | None = None,
                 dp_degree: int | None = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX):
        basic_folder_validation(dir)
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        self.file_list = get_files(dir)
        self.layer_files = sorted(p for p in self.file_list if _LAYER_FILE.fullmatch(os.path.basename(p)))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        if not self.mp_rank_files:
            raise FileNotFoundError(f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find "
                                    f"{MODEL_FILE_PREFIX}* files in there.")
        self.model_state_metadata, self.global_state = self._read_model_states()
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if (self.pp_degree, self.tp_degree, self.dp_degree) != (source.pp_degree, source.tp_degree, source.dp_degree):
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))

    def _read_model_states(self) -> tuple[list[tuple[str, dict]], dict]:
        metadata, globals_ = [], {}
        for index, path in enumerate(self.mp_rank_files):
            state = load_model_states(path)
            metadata.append((path, _small_metadata(state)))
            if index == 0:
                globals_[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    globals_[key] = state.get(key)
            del state
        return metadata, globals_

    def _layer_keys(self) -> list[str]:
        ids = {int(_LAYER_FILE.fullmatch(os.path.basename(p)).group(1)) for p in self.layer_files}
        return [f"{LAYER_FILE_PREFIX}{i:02d}" for i in sorted(ids)]

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def _get_checkpoint_value(self, key: str):
        """A value of the first model-states file (read once more only for a key not kept at construction)."""
        if key not in self.global_state:
            self.global_state[key] = load_model_states(self.mp_rank_files[0]).get(key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        return self._get_checkpoint_value(ITERATION_KEY)

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        """The model-states files the target cell (pp_index, tp_index) takes."""
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list[str]:
        return self._layer_files_for_tp(EMBEDDING_LAYER_INDEX, tp_index)

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        return self._layer_files_for_tp(self.final_layer_norm_idx, tp_index)

    def _layer_files_for_tp(self, layer_index: int, tp_index: int) -> list[str]:
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index] + "-")
        return partition_data(files, self.tp_degree)[tp_index]

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        """The transformer layer keys (all but the first and the final-norm layer) of pipeline stage pp_index."""
        layers = self.layer_keys[1:self.final_layer_norm_idx]
        per_stage = len(layers) // self.pp_degree
        return layers[pp_index * per_stage:(pp_index + 1) * per_stage]


def _aggregate_autoep_zero12_metadata(model_state_metadata: list[tuple[str, dict]]):
    """ds_to_universal's view of a ZeRO-1/2 AutoEP checkpoint's model-states metadata (as
    `DeepSpeedCheckpoint.model_state_metadata` holds it): each file's parameter shapes, the AutoEP
    layers merged by expert_key_prefix (None without any) and the expert-ordering setting, which all
    files must share. Malformed metadata raises RuntimeError naming the file."""
    shapes_by_file, layers, source, ordering = [], {}, {}, {}
    for path, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {path}.")
        shapes_by_file.append(shapes)
        entries = metadata[AUTOEP_LAYERS_KEY]
        if entries is not None:
            if not isinstance(entries, list):
                raise RuntimeError(f"AutoEP metadata must be a list in {path}, got {entries!r}.")
            for entry in entries:
                if not isinstance(entry, dict):
                    raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {path}, got {entry!r}.")
                prefix = entry.get("expert_key_prefix")
                if not isinstance(prefix, str) or not prefix:
                    raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {path}, "
                                       f"got {prefix!r}.")
                if prefix in layers and layers[prefix] != entry:
                    raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                       f"{source[prefix]} and {path}.")
                layers.setdefault(prefix, entry)
                source.setdefault(prefix, path)
        config = metadata["ds_config"]
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}, got {config!r}.")
        value = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(value, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in "
                               f"{path}, got {value!r}.")
        ordering[path] = value
    if len(set(ordering.values())) > 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across "
                           f"model-state files: {ordering}")
    return shapes_by_file, list(layers.values()) or None, next(iter(ordering.values()), False)
