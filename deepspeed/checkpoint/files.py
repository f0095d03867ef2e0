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

import contextlib
import errno
import os
import shutil
from typing import Any, Iterator

import torch

from .stream_save import Streamed, write as write_streamed

MODEL_FILE = "mp_rank_{mp:02d}_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def optim_file(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return OPTIM_FILE.format(prefix="bf16_" if bf16 else "", dp=dp_rank, mp=mp_rank)


def expert_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    """An MoE expert's model states (upstream's layout: one file per layer and global expert id)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def expp_file(ep_rank: int, mp_rank: int = 0) -> str:
    """Stage-0 optimizer states of an expert-parallel rank (upstream's `expp_rank_*`)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_file(mp_rank: int = 0, zero3_dp_rank: int | None = None) -> str:
    if zero3_dp_rank is not None:
        return ZERO3_MODEL_FILE.format(dp=zero3_dp_rank, mp=mp_rank)
    return MODEL_FILE.format(mp=mp_rank)


def _safe_globals() -> list[Any]:
    from collections import OrderedDict

    from ..runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from ..runtime.zero.config import ZeroStageEnum
    from ..runtime.zero.offload_config import OffloadDeviceEnum   # in a saved ds_config written with enum values
    from ..utils.tensor_fragment import fragment_address

    return [OrderedDict, LossScaler, DynamicLossScaler, ZeroStageEnum, OffloadDeviceEnum, fragment_address,
            torch.Size]


_watchers: list[list[str]] = []


@contextlib.contextmanager
def watch_opens() -> Iterator[list[str]]:
    """The paths `load_file` opens inside the block, in order (tests and benchmarks count what a load reads)."""
    seen: list[str] = []
    _watchers.append(seen)
    try:
        yield seen
    finally:
        _watchers.remove(seen)


def load_file(path: str, mmap: bool = True) -> Any:
    """torch.load a checkpoint file safely; errors name the file and what is wrong with it."""
    for seen in _watchers:
        seen.append(path)
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
_FULL = (errno.ENOSPC, errno.EDQUOT)
_write = os.write  # the one place bytes go to a checkpoint file (tests inject faults here)


class _Sink:
    """The file object torch.save writes through: every byte goes through `_write` on a descriptor
    we own, so an OSError keeps its errno ([Note: disk full]). After a failed write it only counts
    (torch.save then completes, and the count is the size the file would have had)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size, self.error, self.pos = fd, 0, None, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.pos += n
        self.size = max(self.size, self.pos)
        while view and self.error is None:
            try:
                view = view[_write(self.fd, view):]
            except OSError as error:
                self.error = error
        return n

    # seekable, for the streamed writer's zip headers (zipfile rewrites each after its data)
    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + pos
        if self.error is None:
            os.lseek(self.fd, self.pos, os.SEEK_SET)
        return self.pos

    def seekable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


class Written:
    """`<path>.tmp` already written (or failed: `error`, not raised yet; `size`: the bytes it needed),
    for save_file to finish: [Note: streamed re-cut] in runtime/checkpoint/stream_recut.py writes the
    file during the save's collective phase and raises its failure in the agreed write phase."""

    def __init__(self, error: BaseException | None, size: int) -> None:
        self.error, self.size = error, size


def write_tmp(obj: Any, path: str, dir_fd: int | None = None, fsync: bool = False) -> Written:
    """torch.save `obj` (or write a Streamed one) to `<path>.tmp`, fsynced if `fsync`; a failure is
    returned in the result, not raised (BaseExceptions such as KeyboardInterrupt are)."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    sink = _Sink(fd)
    error = None
    try:
        try:
            if isinstance(obj, Streamed):   # [Note: streamed checkpoint file]
                write_streamed(obj.obj, sink)
            else:
                torch.save(obj, sink)
        except Exception as failure:  # noqa: BLE001 - returned; torch's own error hides the sink's errno
            error = failure
        error = sink.error or error
        if error is None and fsync:
            os.fsync(fd)
    except OSError as failure:
        error = failure
    except BaseException:
        os.close(fd)
        _unlink(path + ".tmp", dir_fd)
        raise
    os.close(fd)
    return Written(error, sink.size)


def save_file(obj: Any, path: str, dir_fd: int | None = None, shown: str | None = None,
              fsync: bool = True) -> None:
    """torch.save to `path` through `<path>.tmp`, fsync, rename: `path` is complete or absent, and
    a failed write leaves nothing behind. With `dir_fd`, `path` is a name in that directory (the
    directory may be renamed meanwhile: [Note: background save] in runtime/checkpoint/save_job.py);
    `shown` is the path errors name; `fsync=False` leaves durability to the caller (the default
    save: [Note: durable later] in runtime/checkpoint/save_job.py). `obj` may be `Written`: the
    tmp file is there already (or its failure), only the rest is done.

    [Note: disk full]
    torch.save given a file name hides the errno behind its C++ writer ("unexpected pos 36416 vs
    36304"), so the bytes go through a file object of ours: an ENOSPC/EDQUOT (from a write or the
    fsync) becomes `OSError(ENOSPC, "No space left on device (the file needs N bytes, F bytes free
    ...)", path)`, measured once the partial file is removed."""
    shown = shown or path
    durable = FSYNC and fsync
    done = obj if isinstance(obj, Written) else write_tmp(obj, path, dir_fd, durable)
    error = done.error
    if error is None and durable and obj is done:   # written earlier, not flushed then
        try:
            fd = os.open(path + ".tmp", os.O_RDONLY, dir_fd=dir_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as failure:
            error = failure
    if error is not None:
        _unlink(path + ".tmp", dir_fd)
        if isinstance(error, OSError) and error.errno in _FULL:
            raise disk_full(error, shown, done.size, os.path.dirname(shown) if dir_fd is None else dir_fd) from error
        raise error
    os.replace(path + ".tmp", path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def disk_full(error: OSError, path: str, needed: int | None, where: Any) -> OSError:
    """ENOSPC/EDQUOT with the path and the bytes: needed (when known) and free on that file system."""
    try:
        st = os.fstatvfs(where) if isinstance(where, int) else os.statvfs(where or ".")
        free = f", {st.f_bavail * st.f_frsize:,} bytes free on that file system"
    except OSError:
        free = ""
    needs = f"the file needs {needed:,} bytes" if needed else "size unknown"
    what = "Disk quota exceeded" if error.errno == errno.EDQUOT else "No space left on device"
    return OSError(error.errno, f"{what} ({needs}{free})", path)


def _unlink(path: str, dir_fd: int | None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def set_mode(target: int | str, mode: int, shown: str) -> bool:
    """chmod `target` (a descriptor or path); where the file system refuses permission changes (Azure
    Files and other SMB/FUSE mounts: EPERM / ENOTSUP) say so and go on, as DeepSpeed does: the checkpoint
    is whole without the mode (zero_to_fp32.py then runs as `python zero_to_fp32.py`)."""
    try:
        if isinstance(target, int):
            os.fchmod(target, mode)
        else:
            os.chmod(target, mode)
        return True
    except (PermissionError, FileNotFoundError, NotImplementedError) as error:
        reason = error
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise
        reason = error
    from ..utils.logging import logger

    logger.info(f"Could not change the permissions of {shown} to {oct(mode)} ({reason}); continuing without")
    return False


def write_text(path: str, text: str, dir_fd: int | None = None, mode: int = 0o644, fsync: bool = True) -> None:
    """`path` (a name in `dir_fd` when given) replaced atomically by `text`; durable unless not
    `fsync` (the caller flushes it later: [Note: durable later])."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, dir_fd=dir_fd)
    try:
        set_mode(fd, mode, path)  # not masked by the umask
        data = memoryview(text.encode())
        while data:
            data = data[os.write(fd, data):]
        if fsync:
            os.fsync(fd)
    except BaseException as error:
        os.close(fd)
        _unlink(tmp, dir_fd)
        if isinstance(error, OSError) and error.errno in _FULL:
            raise disk_full(error, path, len(text), os.path.dirname(path) if dir_fd is None else dir_fd) from error
        raise
    os.close(fd)
    os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if not fsync:
        return
    if dir_fd is None:
        fsync_dir(os.path.dirname(path) or ".")
    else:
        fsync_fd(dir_fd)


def open_dir(path: str, dir_fd: int | None = None) -> int:
    """A descriptor of the directory `path`: names opened relative to it stay valid when the
    directory (or one above it) is renamed."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0), dir_fd=dir_fd)


def fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries: names created or renamed in it); errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def wait_for_background_saves() -> None:
    """Finish this process's background checkpoint saves (runtime/checkpoint/save_job.py; no
    collective) before reading a checkpoint: one may still be writing the files read here."""
    import sys

    save_job = sys.modules.get("deepspeed.runtime.checkpoint.save_job")
    if save_job is not None:
        save_job.wait_all_local()


def read_latest(load_dir: str, name: str = LATEST) -> str | None:
    wait_for_background_saves()
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


def exists_at(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def remove_tree(name: str, dir_fd: int) -> None:
    """shutil.rmtree(name) relative to `dir_fd` (shutil's dir_fd needs Python 3.11); errors ignored."""
    try:
        fd = open_dir(name, dir_fd)
    except OSError:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        return
    try:
        for entry in os.listdir(fd):
            remove_tree(entry, fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass


def commit_staging(save_dir: str, tag: str, dir_fd: int | None = None, fsync: bool = True) -> str:
    """Rank 0, after every rank wrote its files: publish `.<tag>.partial` as `<tag>` (names in
    `dir_fd`, the save directory's descriptor, when given: it may have been renamed)."""
    own = dir_fd is None
    fd = open_dir(save_dir) if own else dir_fd
    try:
        final, old = tag, f".{tag}.old"
        if not exists_at(final, fd) and exists_at(old, fd):
            os.replace(old, final, src_dir_fd=fd, dst_dir_fd=fd)  # a crash interrupted the previous commit
        remove_tree(old, fd)
        if exists_at(final, fd):
            os.replace(final, old, src_dir_fd=fd, dst_dir_fd=fd)
        os.replace(os.path.basename(staging_dir(save_dir, tag)), final, src_dir_fd=fd, dst_dir_fd=fd)
        if fsync:
            fsync_fd(fd)
        remove_tree(old, fd)
    finally:
        if own:
            os.close(fd)
    return os.path.join(save_dir, tag)


def discard_staging(save_dir: str, tag: str, dir_fd: int | None = None) -> None:
    if dir_fd is None:
        shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)
    else:
        remove_tree(os.path.basename(staging_dir(save_dir, tag)), dir_fd)


def tag_dir(load_dir: str, tag: str) -> str | None:
    """The directory of `tag`, recovering `.<tag>.old` when a crash hit between the commit renames."""
    for candidate in (os.path.join(load_dir, tag), os.path.join(load_dir, f".{tag}.old")):
        if os.path.isdir(candidate):
            return candidate
    return None
