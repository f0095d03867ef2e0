"""The DeepNVMe handle (`AsyncIOBuilder().load().aio_handle`) on real files: byte-exact round trips
at sizes and offsets that are not 4 KiB multiples (upstream's op writes short files there), sync and
async, and errors that name the path and the cause instead of a short file reported as written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepspeed.ops.op_builder import AsyncIOBuilder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _handle(threads: int = 3, block: int = 8192):
    return AsyncIOBuilder().load().aio_handle(block, 8, False, True, threads)


def test_builder_and_getters():
    import deepspeed

    assert AsyncIOBuilder().is_compatible() and deepspeed.ops.__compatible_ops__["async_io"]
    h = AsyncIOBuilder().load().aio_handle(block_size=65536, queue_depth=4, single_submit=True,
                                           overlap_events=False, intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_thread_count()) == (65536, 4, True, False, 2, 2)
    with pytest.raises(ValueError, match="intra_op_parallelism=0"):
        AsyncIOBuilder().load().aio_handle(1024, 8, False, True, 0)


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * 8192 + 5, 200_003])
@pytest.mark.parametrize("offset", [0, 3, 4096, 10_001])
def test_round_trip_unaligned(tmp_path, nbytes, offset):
    h = _handle()
    path = str(tmp_path / "f.bin")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    assert h.sync_pwrite(src, path, offset) == 1
    assert os.path.getsize(path) == offset + nbytes   # never a short file
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read() == bytes(src.numpy())
    dst = torch.empty(nbytes, dtype=torch.uint8)
    assert h.async_pread(dst, path, offset) == 0 and h.wait() == 1
    assert torch.equal(dst, src)
    locked = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    assert locked.data_ptr() % 4096 == 0 and h.is_pinned(locked)
    assert h.pread(locked, path, True, False, offset) == 1   # upstream's positional (validate, async)
    assert torch.equal(locked, src) and h.free_cpu_locked_tensor(locked)


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(torch.cuda.is_available() or not os.path.exists("/proc/self/smaps"),
                    reason="pinned buffers on CUDA; smaps is Linux's")
def test_large_locked_buffers_sit_on_huge_pages_and_round_trip(tmp_path):
    """[Note: huge-page I/O buffers]: from 2 MiB up a buffer starts on a 2 MiB boundary in a mapping
    advised MADV_HUGEPAGE ('hg'); smaller ones stay ordinary. Bytes round-trip at an unaligned size."""
    h = _handle(threads=2, block=1 << 20)
    nbytes = 3 * (1 << 20) + 5
    big = h.new_cpu_locked_tensor(nbytes // 4 + 1, torch.empty(0, dtype=torch.float32))
    small = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float32))
    assert big.data_ptr() % (2 << 20) == 0 and small.data_ptr() % 4096 == 0
    assert "hg" in _vma_flags(big.data_ptr()) and "hg" not in _vma_flags(small.data_ptr())
    path = str(tmp_path / "f.bin")
    src = torch.randn(big.numel())
    assert h.sync_pwrite(src, path) == 1
    assert h.sync_pread(big, path) == 1 and torch.equal(big, src)
    assert h.free_cpu_locked_tensor(big)


def test_async_writes_of_several_dtypes_then_wait(tmp_path):
    h = _handle(threads=4, block=4096)
    tensors = [torch.randn(1000), torch.randn(77, dtype=torch.float64), torch.randn(513).to(torch.bfloat16)]
    for i, t in enumerate(tensors):
        assert h.async_pwrite(t, str(tmp_path / f"{i}.bin")) == 0
    assert h.wait() == 3
    for i, t in enumerate(tensors):
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / f"{i}.bin"))
        assert torch.equal(back, t)
    offsets = [0, 4000, 9000]   # several pieces of one file, written concurrently
    for t, at in zip([torch.randn(1000)] * 3, offsets):
        h.pwrite(t, str(tmp_path / "multi.bin"), False, True, at)
    assert h.wait() == 3 and os.path.getsize(tmp_path / "multi.bin") == 9000 + 4000


def test_read_errors_name_the_path_and_size(tmp_path):
    h = _handle()
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match=r"read of 400 bytes at offset 0 of .*short.bin.*only 100 bytes"):
        h.sync_pread(torch.empty(100), str(path))
    with pytest.raises(OSError, match="no such file"):
        h.async_pread(torch.empty(1), str(tmp_path / "absent.bin"))


_LIMITED_WRITE = """
import resource, signal, sys, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # EFBIG instead of a signal, as on a full device
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.RLIM_INFINITY))
h = AsyncIOBuilder().load().aio_handle(4096, 8, False, True, 2)
h.async_pwrite(torch.zeros(50_000, dtype=torch.uint8), sys.argv[1])
try:
    h.wait()
except OSError as e:
    print("RAISED", e)
"""


def test_short_write_raises_naming_path_size_and_cause(tmp_path):
    """A write the file system cuts short (here a 10 kB file-size limit) raises at wait(), naming
    the path, the bytes asked and the cause; it is never reported as done."""
    path = str(tmp_path / "limited.bin")
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", _LIMITED_WRITE, path], capture_output=True, text=True,
                         timeout=60, env=env).stdout
    assert "RAISED" in out, out
    assert "limited.bin" in out and "File too large" in out and "write of " in out, out


def test_ds_io_and_ds_nvme_tune(tmp_path, capsys):
    """The commands measure through the handle, leave no file behind, and suggest an `aio` section
    the config accepts."""
    from deepspeed.nvme import ds_io_main, tune_main
    from deepspeed.runtime.config.sections.misc import AioConfig

    result = ds_io_main(["--folder", str(tmp_path), "--io_size", "256K", "--read", "--io_parallel", "2",
                         "--loops", "1", "--validate"])
    assert result["read"] and result["GBps"] > 0 and "E2E Read GB/sec" in capsys.readouterr().out
    suggestion = tune_main(["--nvme_dir", str(tmp_path), "--io_size", "128K", "--block_sizes", "64K,128K",
                            "--threads", "1,2", "--loops", "1", "--log_dir", str(tmp_path / "log")])
    aio = AioConfig(**suggestion["aio"])
    assert aio.block_size in (65536, 131072) and aio.threads in (1, 2)
    assert sorted(os.listdir(tmp_path)) == ["log"]
    assert sorted(os.listdir(tmp_path / "log")) == ["aio_config.json", "results.json"]


def test_async_pwrite_to_an_open_direct_descriptor(tmp_path):
    """Upstream's `async_pwrite(buffer=, fd=, file_offset=)` overload, the descriptor opened O_DIRECT
    by the caller (as upstream's offset test does): pieces at 1 KiB offsets land exactly, the
    caller's descriptor stays open."""
    h = _handle(threads=2, block=1024)
    data = h.new_cpu_locked_tensor(4 * 1024 + 100, torch.empty(0, dtype=torch.uint8))
    data.random_(0, 256)
    path = str(tmp_path / "fd.bin")
    fd = os.open(path, os.O_DIRECT | os.O_CREAT | os.O_WRONLY)
    try:
        for lo, hi in ((0, 1024), (1024, 3072), (3072, data.numel())):
            assert h.async_pwrite(buffer=torch.narrow(data, 0, lo, hi - lo), fd=fd, file_offset=lo) == 0
            assert h.wait() == 1
        os.fstat(fd)   # still open
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == bytes(data.numpy())
