"""Helpers for writing state dicts (upstream path: deepspeed.checkpoint.utils)."""

from __future__ import annotations

import os
from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:  # host: upstream's
    """A copy of `item` (a tensor, or dicts / lists / tuples of them) whose tensors are fresh
    clones on `device`: torch.save then writes only each tensor's own elements, not the whole
    storage a view shares with a flat buffer. Other values are returned as they are."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, dict):
        cloned = {key: clone_tensors_for_torch_save(value, device) for key, value in item.items()}
        try:
            return type(item)(cloned)
        except TypeError:          # dict subclasses with another constructor (defaultdict)
            return cloned
    if isinstance(item, (list, tuple)):
        cloned = [clone_tensors_for_torch_save(value, device) for value in item]
        return type(item)(cloned) if not hasattr(item, "_fields") else type(item)(*cloned)
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """`<base_folder>/mp_rank_<mp_rank_str>_model_states.pt` (upstream's helper; pass "00")."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """`<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt` (upstream's helper)."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
