"""Copies out of memory-mapped checkpoint files that hand the file's pages back as they go.

[Note: released reads]
Checkpoint files are loaded memory-mapped (files.load_file): unpickling reads only the small
pickle, and a value's bytes are read when it is sliced. Every page a copy touches, though, stays
mapped into the process (it counts in RSS as RssFile) until the whole file is unmapped, so a load
that copies this rank's 100 MB shard into its optimizer peaks at shard + copy. Here a copy out of a
mapping this process recorded (`Mapping`: made right after the file was loaded, from the
/proc/self/maps line that holds one of its tensors, and holding that tensor, which keeps the whole
mapping alive) goes in chunks, and after each chunk its whole pages are dropped with
madvise(MADV_DONTNEED). The mapping is private and the loader only reads it, so a later read faults
the pages back from the file (the page cache): nothing changes but the resident size. Anything not
known to lie in such a mapping (a fresh tensor, a file of another reader) is copied plainly: dropping
anonymous pages would lose their contents. Linux only; elsewhere every copy is plain.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import torch

CHUNK_BYTES = 8 << 20
MIN_FILE_BYTES = 1 << 20   # smaller files are not looked up (reading /proc/self/maps costs ~1 ms)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_libc: Any = None


class Mapping:
    """The address range [start, end) of one loaded file's mapping. `anchor`, a tensor of that file,
    keeps the whole mapping alive (every storage torch slices from it holds the mapping), so the range
    cannot be unmapped and reused by other memory while this object lives, whatever happens to the
    loaded object's other entries."""

    def __init__(self, start: int, end: int, anchor: torch.Tensor) -> None:
        self.start, self.end, self.anchor = start, end, anchor

    def holds(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return False
        lo = tensor.data_ptr()
        return self.start <= lo and lo + tensor.numel() * tensor.element_size() <= self.end


def _first_tensor(obj: Any) -> torch.Tensor | None:
    stack = [obj]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            if item.untyped_storage().nbytes() > 0:
                return item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def mapping_of(path: str, obj: Any) -> Mapping | None:
    """The private file mapping of `path` that `obj`'s tensors (just loaded memory-mapped) live in;
    None when there is none to find (no tensors, no /proc, madvise unavailable) or the file is small."""
    if _DONTNEED is None or not os.path.exists("/proc/self/maps") or os.path.getsize(path) < MIN_FILE_BYTES:
        return None
    tensor = _first_tensor(obj)
    if tensor is None:
        return None
    address, real = tensor.untyped_storage().data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                ok = len(fields) == 6 and fields[1].endswith("p") and fields[5].strip() == real
                return Mapping(lo, hi, tensor) if ok else None
    return None


def _release(address: int, nbytes: int) -> None:
    global _libc
    page = mmap.PAGESIZE
    lo, hi = -(-address // page) * page, (address + nbytes) // page * page
    if hi <= lo:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.madvise(lo, hi - lo, _DONTNEED)   # a failure only leaves the pages resident


def copy_released(target: torch.Tensor, source: torch.Tensor, mappings: Any = ()) -> None:
    """target.copy_(source); when `source` lies in one of `mappings`, chunk by chunk, each chunk's
    pages of the file released after it is copied ([Note: released reads])."""
    if not any(m.holds(source) for m in mappings):
        target.copy_(source)
        return
    if not target.is_contiguous() or target.shape != source.shape:
        target.copy_(source)
        _release(source.data_ptr(), source.numel() * source.element_size())
        return
    src, dst = source.view(-1), target.view(-1)
    step = max(1, CHUNK_BYTES // source.element_size())
    for lo in range(0, src.numel(), step):
        piece = src[lo:lo + step]
        dst[lo:lo + step].copy_(piece)
        _release(piece.data_ptr(), piece.numel() * piece.element_size())
