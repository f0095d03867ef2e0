# compat: upstream path deepspeed.checkpoint.reshape_3d_utils (DeepSpeed 0.19.8 names).
"""The pipeline x tensor x data layout of a checkpoint's files and how it folds onto a smaller one.

Megatron-DeepSpeed's conversion tools (and upstream's `DeepSpeedCheckpoint`) ask which source files a
target rank reads when a checkpoint saved at (pp, tp, dp) is opened at a layout no larger in any
dimension. Files are numbered as DeepSpeed writes them: model-states file `pp * tp_degree + tp`
(pipeline-major), ZeRO file `dp * pp_degree * tp_degree + that` (data-parallel-major, see
`zero_files`). A target cell gets the source cells of its pipeline block x tensor block, each followed
by its data-parallel copies, and the data-parallel copies are then cut into equal target shares.
"""

from __future__ import annotations

import os
import re

import torch

from .constants import BF16_ZERO_FILE_PREFIX, CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, \
    ZERO_FILE_PREFIX

MODEL_FILE_PREFIX = "mp_rank_"
LAYER_FILE_PREFIX = "layer_"
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX
PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


def get_files(dir: str) -> list[str]:
    """Every file under `dir` (recursively, as upstream lists a checkpoint folder)."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def get_files_with_prefix(all_files: list[str], prefix: str) -> list[str]:
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def get_zero_files(dir: str) -> list[str]:
    """The ZeRO optimizer-states files of one precision prefix, ordered by (dp rank, mp rank)."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            pattern = re.compile(re.escape(prefix) + r"(\d+)_" + MODEL_FILE_PREFIX + r"(\d+)")
            ranked = []
            for path in found:
                match = pattern.search(os.path.basename(path))
                if match is None:
                    raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
                ranked.append((int(match.group(1)), int(match.group(2)), path))
            return [path for _, _, path in sorted(ranked)]
    return []


def partition_data(data_list: list, num_partitions: int) -> list[list]:
    """`data_list` cut into `num_partitions` equal consecutive shares."""
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise ValueError(f"cannot cut {len(data_list)} items into {num_partitions} equal shares")
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


class meg_2d_parallel_map:
    """Per (pipeline index, tensor index): a list of source file indices."""

    def __init__(self, pp_degree: int, tp_degree: int):
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: dict[tuple[int, int], list[int]] = {}

    def simple_init(self) -> None:
        """Each cell holds its own model-states file index (pipeline-major)."""
        self.map = {(i // self.tp_degree, i % self.tp_degree): [i] for i in range(self.pp_degree * self.tp_degree)}

    def _check(self, pp_index, tp_index) -> None:
        for index, degree, name in ((pp_index, self.pp_degree, "pp_index"), (tp_index, self.tp_degree, "tp_index")):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{name}={index} is outside 0..{degree - 1}")

    def add_data(self, pp_index: int, tp_index: int, data: list) -> None:
        self._check(pp_index, tp_index)
        self.map.setdefault((pp_index, tp_index), []).extend(list(data))

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The indices of one cell; None for an index: every cell along it, in order."""
        self._check(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [index for p in pps for t in tps for index in self.map.get((p, t), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for (p, t), value in sorted(self.map.items()):
            print(f"{p},{t} = {value}")


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """Which source model-states files each cell of the smaller (pp, tp) grid takes."""
    if old_pp_degree % new_pp_degree or old_tp_degree % new_tp_degree:
        raise ValueError(f"cannot fold (pp, tp) = ({old_pp_degree}, {old_tp_degree}) onto "
                         f"({new_pp_degree}, {new_tp_degree}): each new degree must divide the old one")
    pp_block, tp_block = old_pp_degree // new_pp_degree, old_tp_degree // new_tp_degree
    folded = meg_2d_parallel_map(new_pp_degree, new_tp_degree)
    for p in range(new_pp_degree):
        for t in range(new_tp_degree):
            folded.add_data(p, t, [pp * old_tp_degree + tp for pp in range(p * pp_block, (p + 1) * pp_block)
                                   for tp in range(t * tp_block, (t + 1) * tp_block)])
    if verbose:
        folded.print_data("final_2d_map:")
    return folded


class model_3d_desc:
    """A checkpoint's (pipeline, tensor, data) parallel degrees."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1):
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def _dims(self, other: "model_3d_desc"):
        return ((PP_DIM, self.pp_degree, other.pp_degree), (TP_DIM, self.tp_degree, other.tp_degree),
                (DP_DIM, self.dp_degree, other.dp_degree))

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        errors = [f"{name} indexing error: index {index} >= degree {degree}"
                  for (name, degree, _), index in zip(self._dims(self), (pp_index, tp_index, dp_index))
                  if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: "model_3d_desc") -> tuple[bool, list[str]]:
        """(ok, reasons): only contraction by a whole factor is possible (each target degree divides ours)."""
        errors = []
        for name, old, new in self._dims(target_3d_desc):
            if new > old:
                errors.append(f"Expansion reshape not supported - {name}: {old} ---> {new}")
            elif new < 1 or old % new:
                errors.append(f"Reshape {name}: {old} ---> {new} needs a degree that divides {old}")
        return not errors, errors

    def reshape(self, target_3d_desc: "model_3d_desc", verbose: bool = False) -> list[meg_2d_parallel_map]:
        """Per target data-parallel rank, the (pp, tp) map of the source ZeRO file indices it reads."""
        ok, errors = self.can_reshape(target_3d_desc)
        if not ok:
            raise ValueError(f"cannot reshape {self.get_desc()} to {target_3d_desc.get_desc()}: " + ", ".join(errors))
        folded = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                         target_3d_desc.tp_degree, verbose)
        stride = self.pp_degree * self.tp_degree
        out = [meg_2d_parallel_map(target_3d_desc.pp_degree, target_3d_desc.tp_degree)
               for _ in range(target_3d_desc.dp_degree)]
        for (p, t), indices in folded.map.items():
            with_dp = [index + dp * stride for index in indices for dp in range(self.dp_degree)]
            for share, cell in zip(partition_data(with_dp, target_3d_desc.dp_degree), out):
                cell.add_data(p, t, share)
        return out


def _degree(dimensions: dict, key: str, model_file: str) -> int:
    value = dimensions.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
    return value


def get_model_3d_descriptor_from_metadata(file_list: list[str], zero_file_list: list[str],
                                          model_state_metadata: list[tuple[str, dict]]) -> model_3d_desc:
    """The layout from each model-states file's recorded `checkpoint_parallel_dimensions` (all or none of
    the files must have it, and they must agree); files without it (older writers): pipeline files give
    tp = the files of layer 01 and pp = model files / tp, else pp 1 and tp = the model-file count."""
    model_files = [path for path, _ in model_state_metadata]
    recorded, missing = [], []
    for path, metadata in model_state_metadata:
        dimensions = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dimensions is None:
            missing.append(path)
            continue
        if not isinstance(dimensions, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {path}, "
                               f"got {type(dimensions).__name__}.")
        recorded.append((_degree(dimensions, CHECKPOINT_PP_DEGREE, path),
                         _degree(dimensions, CHECKPOINT_TP_DEGREE, path)))
    if recorded:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(recorded)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                               f"{dict(zip(model_files, recorded))}")
        pp, tp = recorded[0]
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        if len(zero_file_list) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
    else:
        layer01 = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
        tp = layer01 or max(1, len(model_files))
        pp = max(1, len(model_files) // tp) if layer01 else 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def load_model_states(path: str) -> dict:
    """One model-states file, as DeepSpeed's inspection tools load it (any pickled object, e.g. Megatron's
    `args`: only inspect checkpoints you trust)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def get_model_3d_descriptor(dir: str) -> model_3d_desc:
    """The (pp, tp, dp) layout of the checkpoint tag folder `dir` (reads each model-states file once)."""
    files = get_files(dir)
    metadata = [(path, {CHECKPOINT_PARALLEL_DIMS: load_model_states(path).get(CHECKPOINT_PARALLEL_DIMS)})
                for path in get_files_with_prefix(files, MODEL_FILE_PREFIX)]
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), metadata)
