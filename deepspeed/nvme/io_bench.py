"""`ds_io` and `ds_nvme_tune`: a path's read/write bandwidth through the DeepNVMe handle, and the
`aio` config section that measured best (upstream's commands of the same names).

Every measurement moves one 4 KiB-aligned host buffer (`new_cpu_locked_tensor`, pinned on CUDA) to
or from one file in the folder; writes are timed up to `fsync` (what is on the device, not in the
page cache) and reads go through `O_DIRECT` where the file system allows it, so the page cache does
not flatter either number. The file is removed afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import torch

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str | int) -> int:
    """"1M" -> 1048576; plain integers are bytes."""
    text = str(text).strip().upper().rstrip("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def measure(folder: str, io_size: int, block_size: int, threads: int, read: bool, loops: int = 3,
            queue_depth: int = 32, single_submit: bool = False, overlap_events: bool = True,
            validate: bool = False, direct: bool = True) -> dict[str, Any]:
    """Best-of-`loops` bandwidth (GB/s, 1e9 bytes) of one `io_size` transfer with these settings
    (`direct=False`: buffered I/O only; reads then start from a dropped page cache where allowed)."""
    from ..ops.aio import aio_handle

    handle = aio_handle(block_size, queue_depth, single_submit, overlap_events, threads)
    handle.use_direct = direct
    buffer = handle.new_cpu_locked_tensor(io_size, torch.empty(0, dtype=torch.uint8))  # host: a dtype example
    buffer.random_(0, 256)
    path = os.path.join(folder, f".ds_io_{os.getpid()}.bin")
    best = float("inf")
    try:
        handle.sync_pwrite(buffer, path)
        if read:   # the file on the device before the first timed read
            _fsync(path)
        for _ in range(loops):
            if read and not direct:
                _drop_page_cache(path)
            start = time.perf_counter()
            if read:
                handle.sync_pread(buffer, path, 0) if not validate else handle.pread(buffer, path, True, False, 0)
            else:
                handle.sync_pwrite(buffer, path) if not validate else handle.pwrite(buffer, path, True, False, 0)
                _fsync(path)
            best = min(best, time.perf_counter() - start)
    finally:
        handle.close()
        if os.path.exists(path):
            os.remove(path)
    return {"read": read, "io_size": io_size, "block_size": block_size, "threads": threads,
            "seconds": best, "GBps": io_size / best / 1e9}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_page_cache(path: str) -> None:
    """Evict `path` from the page cache (fsync, then POSIX_FADV_DONTNEED) so a buffered read
    reaches the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ds_io_main(argv: list[str] | None = None) -> dict[str, Any]:
    """`ds_io --folder DIR --io_size 1G [--read] [--block_size 1M] [--io_parallel N] ...`."""
    p = argparse.ArgumentParser(prog="ds_io", description="Read or write bandwidth of a folder through the "
                                                          "DeepNVMe handle (deepspeed.ops.aio).")
    p.add_argument("--folder", required=True, help="folder to do the I/O in (on the device to measure)")
    p.add_argument("--io_size", required=True, help="bytes to read or write (K, M, G suffixes)")
    p.add_argument("--read", action="store_true", help="measure reads (default: writes)")
    p.add_argument("--block_size", default="1M", help="bytes per positional call (default 1M)")
    p.add_argument("--queue_depth", type=int, default=32)
    p.add_argument("--single_submit", action="store_true")
    p.add_argument("--sequential_requests", action="store_true", help="overlap_events off")
    p.add_argument("--io_parallel", type=int, default=1, help="threads per request (intra_op_parallelism)")
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--validate", action="store_true", help="compare the bytes after each transfer")
    args = p.parse_args(argv)
    result = measure(args.folder, parse_size(args.io_size), parse_size(args.block_size), args.io_parallel, args.read,
                     args.loops, args.queue_depth, args.single_submit, not args.sequential_requests, args.validate)
    kind = "Read" if args.read else "Write"
    print(f"E2E {kind} Latency sec = {result['seconds']:.4f}")
    print(f"E2E {kind} GB/sec = {result['GBps']:.2f}")
    return result


def sweep(folder: str, io_size: int, block_sizes: list[int], threads: list[int], reads: list[bool],
          loops: int) -> list[dict[str, Any]]:
    return [measure(folder, io_size, b, t, r, loops)
            for r, b, t in itertools.product(reads, block_sizes, threads)]


def suggest(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The `aio` section of the settings whose slower direction is fastest (a step reads and writes)."""
    by_setting: dict[tuple[int, int], list[float]] = {}
    for r in results:
        by_setting.setdefault((r["block_size"], r["threads"]), []).append(r["GBps"])
    (block, threads), _ = max(by_setting.items(), key=lambda kv: (min(kv[1]), sum(kv[1])))
    return {"aio": {"block_size": block, "queue_depth": 32, "intra_op_parallelism": threads,
                    "single_submit": False, "overlap_events": True, "use_gds": False}}


def tune_main(argv: list[str] | None = None) -> dict[str, Any]:
    """`ds_nvme_tune --nvme_dir DIR [--io_size 256M]`: sweep block sizes and threads, print the table
    and the suggested `aio` section (also written to `--log_dir`/aio_config.json)."""
    p = argparse.ArgumentParser(prog="ds_nvme_tune", description="Measure a folder's read/write bandwidth "
                                "through the DeepNVMe handle and suggest the aio config section.")
    p.add_argument("--nvme_dir", nargs="+", required=True, help="folder(s) on the device NVMe offload will use")
    p.add_argument("--io_size", default="256M", help="bytes per transfer (default 256M)")
    p.add_argument("--block_sizes", default="256K,1M,4M", help="comma-separated block sizes to try")
    p.add_argument("--threads", default="1,2,4,8", help="comma-separated intra_op_parallelism values to try")
    p.add_argument("--no_read", action="store_true")
    p.add_argument("--no_write", action="store_true")
    p.add_argument("--loops", type=int, default=2)
    p.add_argument("--log_dir", default=None, help="write results.json and aio_config.json here")
    args = p.parse_args(argv)
    reads = [r for r, off in ((False, args.no_write), (True, args.no_read)) if not off]
    if not reads:
        p.error("--no_read and --no_write leave nothing to measure")
    blocks = [parse_size(b) for b in args.block_sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    results = []
    for folder in args.nvme_dir:
        print(f"Running DeepNVMe performance tuning on {folder}")
        results += sweep(folder, parse_size(args.io_size), blocks, threads, reads, args.loops)
    print(f"{'op':<6}{'block':>10}{'threads':>9}{'GB/s':>8}")
    for r in results:
        print(f"{'read' if r['read'] else 'write':<6}{r['block_size']:>10}{r['threads']:>9}{r['GBps']:>8.2f}")
    suggestion = suggest(results)
    print("Suggested config section:")
    print(json.dumps(suggestion, indent=2))
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.log_dir, "aio_config.json"), "w") as f:
            json.dump(suggestion, f, indent=2)
    return suggestion
