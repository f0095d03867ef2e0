"""Checkpoint files on disk: safe loading, DeepSpeed's file names, atomic tag directories.

[Note: crash-safe save]
All ranks write a tag into a hidden staging directory `<save_dir>/.<tag>.partial`; only after
every rank reported success does rank 0 rename it to `<save_dir>/<tag>` (an existing tag of the
same name is first moved to `.<tag>.old`, then removed) and then replace `latest` atomically.
A process killed at any moment therefore leaves the previous checkpoint complete and `latest`
naming it. The one window where `<tag>` itself is absent (between the two renames when a tag
is overwritten) is repaired on load: `.<tag>.old` is used when `<tag>` is missing.

[Note: safe loading]
Files are read with `torch.load(weights_only=True)`, which refuses arbitrary pickled code.
DeepSpeed's own files pickle a few of its classes (loss scalers, the ZeRO stage enum, the
fragment address of `param_slice_mappings`); this package defines compatible classes at the
same import paths and allows exactly those, so DeepSpeed-written checkpoints load safely too.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

MODEL_FILE = "mp_rank_{mp:02d}_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def optim_file(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return OPTIM_FILE.format(prefix="bf16_" if bf16 else "", dp=dp_rank, mp=mp_rank)


def model_file(mp_rank: int = 0, zero3_dp_rank: int | None = None) -> str:
    if zero3_dp_rank is not None:
        return ZERO3_MODEL_FILE.format(dp=zero3_dp_rank, mp=mp_rank)
    return MODEL_FILE.format(mp=mp_rank)


def _safe_globals() -> list[Any]:
    from collections import OrderedDict

    from ..runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from ..runtime.zero.config import ZeroStageEnum
    from ..utils.tensor_fragment import fragment_address

    return [OrderedDict, LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, torch.Size]


def load_file(path: str, mmap: bool = True) -> Any:
    """torch.load a checkpoint file safely; errors name the file and what is wrong with it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # torch raises RuntimeError / UnpicklingError / EOFError / ...
        size = os.path.getsize(path)
        text = str(error).split("\n")[0]
        if "Unsupported global" in str(error) or "weights_only" in str(error).lower() and "GLOBAL" in str(error):
            raise CheckpointError(f"{path}: refuses to load with torch.load(weights_only=True): it pickles a class "
                                  f"this package does not allow ({text}). Only load checkpoints you trust; convert "
                                  "it with torch.load(weights_only=False) yourself if you do.") from error
        raise CheckpointError(f"{path} ({size} bytes) is truncated or corrupt: {text}") from error


# fsync makes a published checkpoint survive a power loss or kernel crash too (renames alone
# already protect against a killed process); it costs about 0.1 s per 230 MB on this project's disk.
FSYNC = os.environ.get("DEEPSPEED_CHECKPOINT_FSYNC", "1") != "0"


def save_file(obj: Any, path: str) -> None:
    """torch.save to `path` through a temporary name (and fsync), so `path` is complete or absent.

    torch.save is given the file name, not a Python file object: its C++ writer then writes the
    records directly (10-20% faster than through `handle.write`); the fsync goes through a
    second descriptor, which flushes the same inode."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    if FSYNC:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries: names created or renamed in it); errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_latest(load_dir: str, name: str = LATEST) -> str | None:
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read().strip()


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def prepare_staging(save_dir: str, tag: str) -> str:
    """Rank 0: an empty staging directory for `tag` (a stale one from a crashed save is removed)."""
    path = staging_dir(save_dir, tag)
    os.makedirs(save_dir, exist_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def commit_staging(save_dir: str, tag: str) -> str:
    """Rank 0, after every rank wrote its files: publish `.<tag>.partial` as `<tag>`."""
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.old")
    if not os.path.exists(final) and os.path.isdir(old):
        os.replace(old, final)  # a crash interrupted the previous commit: restore before replacing
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(staging_dir(save_dir, tag), final)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def discard_staging(save_dir: str, tag: str) -> None:
    shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)


def tag_dir(load_dir: str, tag: str) -> str | None:
    """The directory of `tag`, recovering `.<tag>.old` when a crash hit between the commit renames."""
    for candidate in (os.path.join(load_dir, tag), os.path.join(load_dir, f".{tag}.old")):
        if os.path.isdir(candidate):
            return candidate
    return None
