# compat: upstream path deepspeed.checkpoint.zero_checkpoint (DeepSpeed 0.19.8 names).
"""`ZeROCheckpoint`: which ZeRO optimizer-states files each rank of a (possibly smaller) layout reads."""

from __future__ import annotations

import os

from .reshape_3d_utils import get_model_3d_descriptor, get_zero_files, model_3d_desc


def basic_folder_validation(dir: str) -> None:
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"{dir}: not an existing checkpoint folder")


class ZeROCheckpoint:
    """The ZeRO files of the checkpoint folder `dir`, their source layout and a target layout."""

    def __init__(self, dir: str, source_3d: model_3d_desc | None = None):
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.num_files:
            raise FileNotFoundError(f"No ZeRO files found in {dir}")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.reshape(model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree))

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def print_3d_index_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, cells in enumerate(self._3d_file_map):
            cells.print_data(f"dp = {dp_index}")
