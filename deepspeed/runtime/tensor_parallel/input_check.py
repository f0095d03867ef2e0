"""The first forward's check that every tensor-parallel rank got the same batch (upstream's
`first_dataloader_check`).

TP ranks of one replica compute slices of one forward: if their data loaders disagree, every row
layer all-reduces partial products of different samples, and training silently goes wrong. So the
first forward under AutoTP compares a digest of its inputs (each tensor's shape, dtype and bytes) over
the TP group; every rank sees all digests, so all raise together or none does. The hook removes
itself once a forward passed (one `all_gather_object` of a few bytes per rank, once).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

MESSAGE = "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."


def _digest(value: Any) -> Any:
    """A picklable summary that is equal exactly when the tensors in `value` are (structure kept)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", tuple(value.shape), str(value.dtype), hashlib.sha1(data).hexdigest())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_digest(v) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((str(k), _digest(v)) for k, v in value.items()))
    return ("other", type(value).__name__)   # non-tensor arguments (flags, configs) are not compared


def install(module: torch.nn.Module, group: Any) -> Any:
    """Register the check on `module`'s next forward; returns the hook handle."""
    from ... import comm as ds_comm

    handle = None

    def check(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mine = _digest((args, kwargs))
        seen: list[Any] = [None] * ds_comm.get_world_size(group)
        ds_comm.all_gather_object(seen, mine, group=group)
        if any(d != seen[0] for d in seen):
            raise AssertionError(MESSAGE)
        handle.remove()

    handle = module.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
    return handle
