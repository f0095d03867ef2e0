"""The DeepNVMe I/O handle (upstream's ``async_io`` op, ``aio_handle``) in Python over the OS.

[Note: the pure-Python I/O engine]
Upstream submits libaio requests from C++ threads. Here each request is cut into
`intra_op_parallelism` contiguous chunks, one per pool thread, and each thread moves its chunk with
positional `os.preadv` / `os.pwritev` calls of at most `block_size` bytes; both release the GIL, so
the threads run in parallel and the caller keeps computing while an async request is in flight.
Files are opened with `O_DIRECT` where the file system takes it (ext4, xfs; not every tmpfs):
the part of a chunk whose buffer address and file offset share the 4 KiB alignment goes through the
direct descriptor, the unaligned head and tail (under 4 KiB each) through a buffered one, so any
size and offset round-trips byte-exact (upstream's op writes short files when the size is not a
4 KiB multiple). Buffers from `new_cpu_locked_tensor` are 4 KiB aligned (pinned on CUDA; on 2 MiB huge pages
from 2 MiB up otherwise: [Note: huge-page I/O buffers]), so whole swap tensors take the direct path.
Measured on this machine's disk (BENCHMARKS.md, NVMe section).
Errors raise `OSError` naming the path, the byte range and the cause; a read past the end of the
file or a short write never reports success. An async error is raised by the `wait()` that
collects it (every pending request is waited for first, so no thread writes into a freed buffer).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

ALIGNMENT = 4096   # O_DIRECT alignment of address, offset and length (a page; covers 512 B sectors)
_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_DIRECT_ENV = "DS_AIO_NO_DIRECT"   # set to 1 to force buffered I/O (for measurements)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory (any dtype, bf16 included)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class _Files:
    """The descriptors of one request: a buffered one always, a direct one where the FS allows."""

    def __init__(self, path: str, write: bool, use_direct: bool) -> None:
        self.path = path
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        try:
            self.buffered = os.open(path, flags, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"aio: cannot open {path!r} for {'write' if write else 'read'}: "
                                   f"{os.strerror(e.errno)}") from e
        self.direct = -1
        if use_direct and _DIRECT:
            try:
                self.direct = os.open(path, flags | _DIRECT, 0o600)
            except OSError:   # EINVAL: this file system has no direct I/O; buffered it is
                self.direct = -1

    @classmethod
    def borrowed(cls, fd: int) -> "_Files":
        """The caller's open descriptor (upstream's `async_pwrite(buffer, fd, file_offset)`): used as
        the direct one if opened O_DIRECT, with a buffered one of the same file for unaligned parts;
        the caller's descriptor is never closed here."""
        files = cls.__new__(cls)
        files.path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else f"fd {fd}"
        direct = bool(_DIRECT) and bool(_fcntl_flags(fd) & _DIRECT)
        files.buffered = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY) if direct else os.dup(fd)
        files.direct, files._owned_direct = (fd, False) if direct else (-1, True)
        return files

    _owned_direct = True

    def close(self) -> None:
        for fd in (self.buffered, self.direct if self._owned_direct else -1):
            if fd >= 0:
                os.close(fd)
        self.buffered = self.direct = -1


def _fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _move(fd: int, view: memoryview, offset: int, write: bool, block: int, path: str) -> None:
    """Move all of `view` to/from file `offset`, retrying partial transfers; raise on EOF/errors."""
    done, total = 0, len(view)
    while done < total:
        piece = view[done:min(total, done + block)]
        try:
            n = os.pwritev(fd, [piece], offset + done) if write else os.preadv(fd, [piece], offset + done)
        except OSError as e:
            raise OSError(e.errno, f"aio: {'write' if write else 'read'} of {total} bytes at offset {offset} "
                                   f"of {path!r} failed after {done} bytes: {os.strerror(e.errno)}") from e
        if n <= 0:
            what = "wrote nothing (device full?)" if write else "reached the end of the file"
            raise OSError(errno_mod.ENOSPC if write else errno_mod.EIO,
                          f"aio: {'write' if write else 'read'} of {total} bytes at offset {offset} of {path!r} "
                          f"{what} after {done} bytes")
        done += n


def _chunk_job(files: _Files, view: memoryview, address: int, offset: int, write: bool, block: int) -> None:
    """One thread's chunk: unaligned head and tail buffered, the aligned middle direct."""
    size = len(view)
    head = tail = size
    if files.direct >= 0 and (address - offset) % ALIGNMENT == 0:
        head = min(size, (-offset) % ALIGNMENT)
        tail = head + (size - head) // ALIGNMENT * ALIGNMENT
    if head:
        _move(files.buffered, view[:head], offset, write, block, files.path)
    if tail > head:
        try:
            _move(files.direct, view[head:tail], offset + head, write, block, files.path)
        except OSError as e:
            if e.errno != errno_mod.EINVAL:
                raise
            _move(files.buffered, view[head:tail], offset + head, write, block, files.path)  # FS refused direct
    if tail < size:
        _move(files.buffered, view[tail:], offset + tail, write, block, files.path)


class _Request:
    """One read or write in flight: its chunk futures, descriptors and the tensors it keeps alive."""

    def __init__(self, files: _Files, futures: list[Future], keep: tuple, finish: Any = None) -> None:
        self.files, self.futures, self.keep, self.finish = files, futures, keep, finish

    def complete(self) -> BaseException | None:
        error = None
        for f in self.futures:
            e = f.exception()
            error = error or e
        self.files.close()
        if error is None and self.finish is not None:
            self.finish()   # a device tensor's bounce buffer copied back
        return error


class aio_handle:  # noqa: N801 (upstream's name)
    """Upstream's `aio_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)`: [Note: the pure-Python I/O engine]. Upstream keeps `queue_depth` libaio
    requests of `block_size` bytes in flight per thread; here each positional call moves up to
    `block_size * queue_depth` bytes, which is the same thing on `O_DIRECT`: the kernel submits every
    device request of one call (cut at the queue's max_sectors) before it waits for any
    ([Note: huge-page I/O buffers] has the numbers). `single_submit` and `overlap_events` shape libaio
    submission upstream; they are kept and reported here, and have no other effect."""

    def __init__(self, block_size: int = 1024 * 1024, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if int(value) <= 0:
                raise ValueError(f"aio_handle: {name}={value!r} must be a positive integer")
        self._block_size, self._queue_depth = int(block_size), int(queue_depth)
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._threads = int(intra_op_parallelism)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="ds_aio")
        self._pending: list[_Request] = []
        self._lock = threading.Lock()
        self._locked: dict[int, torch.Tensor] = {}
        self.use_direct = os.environ.get(_NO_DIRECT_ENV, "0") in ("", "0")

    # --- getters (upstream's) -----------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._threads

    get_thread_count = get_intra_op_parallelism   # the pre-0.15 name

    def get_alignment(self) -> int:
        return self._threads * ALIGNMENT

    # --- requests -------------------------------------------------------------------------------
    def _submit(self, buffer: torch.Tensor, path: Any, write: bool, file_offset: int) -> _Request:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"aio: buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if not buffer.is_contiguous():
            raise ValueError(f"aio: buffer for {path!r} must be contiguous")
        fd = path if isinstance(path, int) else None
        path, file_offset = (f"fd {fd}" if fd is not None else os.fspath(path)), int(file_offset)
        if file_offset < 0:
            raise ValueError(f"aio: file_offset={file_offset} for {path!r} must be >= 0")
        host, finish = buffer, None
        if buffer.device.type != "cpu":   # a device tensor: through a host bounce buffer
            host = self.new_cpu_locked_tensor(buffer.numel(), buffer)
            if write:
                host.copy_(buffer.reshape(-1))
            else:
                def finish(dst=buffer, src=host):
                    dst.view(-1).copy_(src)
        nbytes = host.numel() * host.element_size()
        if not write:
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size < file_offset + nbytes:
                raise OSError(errno_mod.EINVAL if size >= 0 else errno_mod.ENOENT,
                              f"aio: read of {nbytes} bytes at offset {file_offset} of {path!r}: "
                              + ("no such file" if size < 0 else f"the file has only {size} bytes"))
        files = _Files.borrowed(fd) if fd is not None else _Files(path, write, self.use_direct)
        view, address = _byte_view(host), host.data_ptr()
        bounds = self._chunks(nbytes)
        futures = [self._pool.submit(_chunk_job, files, view[a:b], address + a, file_offset + a, write,
                                     self._block_size * self._queue_depth) for a, b in bounds]
        return _Request(files, futures, (buffer, host), finish)

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        """Cut [0, nbytes) into at most `intra_op_parallelism` pieces on 4 KiB boundaries."""
        if nbytes == 0:
            return []
        per = -(-nbytes // self._threads)
        per = -(-per // ALIGNMENT) * ALIGNMENT
        return [(a, min(nbytes, a + per)) for a in range(0, nbytes, per)]

    def _run(self, buffer: torch.Tensor, path: str, write: bool, asynchronous: bool, file_offset: int,
             validate: bool = False) -> int:
        request = self._submit(buffer, path, write, file_offset)
        if validate:
            request.finish = self._validator(request, path, write, file_offset)
        with self._lock:
            self._pending.append(request)
        return 0 if asynchronous else self.wait()

    @staticmethod
    def _validator(request: _Request, path: str, write: bool, file_offset: int) -> Any:
        previous = request.finish

        def check() -> None:
            if previous is not None:
                previous()
            data = request.keep[1]
            with open(path, "rb") as f:
                f.seek(file_offset)
                on_disk = f.read(data.numel() * data.element_size())
            if bytes(_byte_view(data)) != on_disk:
                raise OSError(errno_mod.EIO, f"aio: validation of the {'write' if write else 'read'} of "
                                             f"{path!r} at offset {file_offset} failed: bytes differ")
        return check

    def wait(self) -> int:
        """Wait for every pending request; return how many completed. Raises the first error."""
        with self._lock:
            pending, self._pending = self._pending, []
        error = None
        for request in pending:
            try:
                e = request.complete()
            except BaseException as exc:   # a validation or bounce-copy failure
                e = exc
            error = error or e
        if error is not None:
            raise error
        return len(pending)

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
              file_offset: int = 0, **kwargs: Any) -> int:
        """Parallel read; upstream's keyword is `async` (a Python keyword), accepted via kwargs."""
        return self._run(buffer, filename, False, kwargs.pop("async", async_op), file_offset, validate)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
               file_offset: int = 0, **kwargs: Any) -> int:
        return self._run(buffer, filename, True, kwargs.pop("async", async_op), file_offset, validate)

    def read(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        return self._run(buffer, filename, False, False, file_offset, validate)

    def write(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        return self._run(buffer, filename, True, False, file_offset, validate)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(buffer, filename, True, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._run(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str | None = None, file_offset: int = 0,
                     fd: int | None = None) -> int:
        """Upstream's two overloads: to `filename`, or to an open descriptor `fd` (not closed)."""
        if (filename is None) == (fd is None):
            raise TypeError("aio: async_pwrite takes exactly one of filename= and fd=")
        return self._run(buffer, filename if fd is None else int(fd), True, True, file_offset)

    # --- page-locked buffers ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D host tensor of `num_elem` elements of `example_tensor`'s dtype, 4 KiB aligned
        (the direct path), page-locked where CUDA can pin."""
        return aligned_host_tensor(int(num_elem), example_tensor.dtype, self._locked)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return self._locked.pop(tensor.data_ptr(), None) is not None

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return buffer.data_ptr() in self._locked or (buffer.device.type == "cpu" and _pinned(buffer))

    def close(self) -> None:
        if self._pending:
            self.wait()
        self._pool.shutdown(wait=True)


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:
        return False


def aligned_host_tensor(numel: int, dtype: torch.dtype, registry: dict | None = None) -> torch.Tensor:
    """A 1-D host tensor whose data starts on a 4 KiB boundary; pinned when CUDA is available, else
    on transparent huge pages from 2 MiB up ([Note: huge-page I/O buffers])."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()   # host: a dtype probe
    pin = torch.cuda.is_available()
    out = None if pin or nbytes < HUGE_PAGE else _huge_page_bytes(nbytes)
    if out is None:
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device="cpu", pin_memory=pin)  # host: I/O buffer
        skip = (-raw.data_ptr()) % ALIGNMENT
        out = raw[skip:skip + nbytes]
    out = out.view(dtype)
    if registry is not None:
        registry[out.data_ptr()] = out
    return out


# [Note: huge-page I/O buffers]
# This machine's virtio disk takes at most 254 scatter-gather segments per request
# (/sys/block/*/queue/max_segments), so a 1 MiB direct transfer into 4 KiB pages (256 segments) is
# split in two requests, one of them 8 KiB; `dd` and upstream's libaio op pay the same. On a buffer
# backed by 2 MiB transparent huge pages a 1 MiB transfer is one segment. Measured on one 512 MiB
# file, rounds rotated: direct reads 1.9 -> 2.4 GB/s at 1 thread, 2.2-2.8 at 4 (BENCHMARKS.md, NVMe).
# Fewer, larger calls then help too: one call of 1 MiB reads 2.4 GB/s at 1 thread and 2.7 at 4; of
# 4-32 MiB, 2.8-2.9 at any thread count, the disk's ceiling here (`aio_handle` moves
# block_size x queue_depth bytes per call, upstream's bytes in flight per thread).
# The memory is a private anonymous mapping (never reused heap pages, which keep their small pages),
# advised MADV_HUGEPAGE before first touch; the tensor keeps the mapping alive and unmaps it with it.
# Where the kernel has no THP (or `never`), the advice is a no-op and the buffer is an ordinary one.
HUGE_PAGE = 2 << 20


def _huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh private memory starting on a 2 MiB boundary, advised MADV_HUGEPAGE."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # the tensor holds `region` alive
    skip = (-whole.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(advice, skip, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:   # EINVAL: THP compiled out; an ordinary page-aligned buffer is still correct
        pass
    return whole[skip:skip + nbytes]
