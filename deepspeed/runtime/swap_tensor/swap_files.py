"""The swap directory a run owns under `nvme_path`: [Note: swap file ownership].

[Note: swap file ownership]
Each swapper (the optimizer-state one; the parameter one reuses this) makes one directory
`nvme_path/ds_swap_<purpose>_rank<global rank>_<pid>_<random>/` holding an owner file
(`OWNER_FILE`: host and pid as JSON). It is removed at exit (atexit), by `engine.destroy()` and
when the swapper is garbage collected. A run killed before that leaves the directory behind: the next
run that swaps under the same `nvme_path` removes every `ds_swap_*` directory whose owner file names
this host and a pid that no longer runs. Nothing else under `nvme_path` is touched: a directory
without the prefix and an owner file, or owned by a live process or another host, stays.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import uuid
import weakref

import torch

PREFIX = "ds_swap_"
OWNER_FILE = ".deepspeed_swap_owner"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def remove_leftovers(nvme_path: str) -> list[str]:
    """Remove the swap directories of dead runs on this host under `nvme_path`; return them."""
    removed = []
    try:
        entries = os.listdir(nvme_path)
    except OSError:
        return removed
    host = socket.gethostname()
    for name in entries:
        path = os.path.join(nvme_path, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue   # not ours (or not yet written by a starting run): leave it
        if owner.get("host") == host and not _alive(int(owner.get("pid", -1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SwapDir:
    """One run-owned directory of swap files ([Note: swap file ownership])."""

    def __init__(self, nvme_path: str, purpose: str, rank: int) -> None:
        self.leftovers = remove_leftovers(nvme_path)
        name = f"{PREFIX}{purpose}_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(nvme_path, name)
        try:
            os.makedirs(self.path)
            with open(os.path.join(self.path, OWNER_FILE), "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        except OSError as e:
            _remove(self.path)
            raise OSError(e.errno, f"NVMe offload: cannot create the swap directory {self.path!r} under "
                                   f"nvme_path: {os.strerror(e.errno or 0)}") from e
        # removed at exit and when this object goes away, whichever first (a finalizer runs once)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        atexit.register(self._finalizer)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        self._finalizer()

    def nbytes(self) -> int:
        """Bytes of the swap files now on disk (tests count them)."""
        total = 0
        for name in os.listdir(self.path) if os.path.isdir(self.path) else ():
            if name != OWNER_FILE:
                total += os.path.getsize(os.path.join(self.path, name))
        return total


def pread_exact(fd: int, tensor: "torch.Tensor", offset: int, path: str) -> None:
    """Fill the contiguous CPU `tensor` from byte `offset` of the open file `fd` (`path`: for errors)."""
    view = memoryview(tensor.view(torch.uint8).numpy())
    while view:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise OSError(f"{path}: short read at byte {offset} (file truncated?)")
        view, offset = view[got:], offset + got
