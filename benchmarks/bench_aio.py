"""NVMe I/O bandwidth on one path: `dd` with direct I/O (one 1 MiB stream), our DeepNVMe handle
(deepspeed.ops.aio, Python over the OS) at several thread counts, direct and buffered, and DeepSpeed
0.19.8's `async_io` op (libaio, JIT-built in /tmp/ds-venv) when it builds here.

    python benchmarks/bench_aio.py --dir /tmp/ds_aio_bench --size_mb 512 --threads 1,2,4,8

Writes are timed to durability (dd conv=fsync; fsync after ours and upstream's), reads with O_DIRECT
(buffered reads start from an evicted page cache). Each figure is the best of --loops runs, the
configurations interleaved, since the disk is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

UPSTREAM_PY = "/tmp/ds-venv/bin/python"
_UPSTREAM = r"""
import json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
path, size, threads, loops = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
shared = sys.argv[5] if len(sys.argv) > 5 else None   # read this file instead of the one written
ops = sys.argv[6] if len(sys.argv) > 6 else "write,read"
if not AsyncIOBuilder().is_compatible():
    print(json.dumps({"error": "AsyncIOBuilder().is_compatible() is False (libaio missing?)"})); sys.exit()
op = AsyncIOBuilder().load(verbose=False)
out = {}
for t in threads:
    h = op.aio_handle(1 << 20, 32, False, True, t)
    buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8)); buf.random_(0, 256)
    w = r = float("inf")
    for _ in range(loops):
        if "write" in ops:
            s = time.perf_counter(); h.sync_pwrite(buf, path); fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
            w = min(w, time.perf_counter() - s)
        if "read" in ops:
            s = time.perf_counter(); h.sync_pread(buf, shared or path); r = min(r, time.perf_counter() - s)
    out[t] = {"write": size / w / 1e9, "read": size / r / 1e9}
    h.free_cpu_locked_tensor(buf)
if os.path.exists(path):
    os.remove(path)
print(json.dumps(out))
"""


def dd(path: str, size_mb: int, read: bool) -> float:
    """GB/s of one dd stream of 1 MiB blocks with direct I/O (a read reads the whole file)."""
    cmd = (["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"] if read else
           ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "oflag=direct", "conv=fsync"])
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    seconds = float(re.search(r"copied, ([0-9.e+-]+) s", text).group(1))
    return size_mb * (1 << 20) / seconds / 1e9


def upstream(path: str, size: int, threads: list[int], loops: int, shared: str | None = None,
             ops: str = "write,read") -> dict:
    if not os.path.exists(UPSTREAM_PY):
        return {"error": f"{UPSTREAM_PY} not found"}
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": "/tmp/ds-ext"}
    proc = subprocess.run([UPSTREAM_PY, "-c", _UPSTREAM, path, str(size), ",".join(map(str, threads)), str(loops)]
                          + ([shared or path, ops] if shared or ops != "write,read" else []),
                          capture_output=True, text=True, cwd="/tmp", env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (proc.stderr or proc.stdout)[-800:]}


def paired(args: argparse.Namespace, measure) -> None:
    """Ours against dd (and upstream's op unless --no_upstream) in adjacent runs, the order rotated
    each round: on a disk whose speed drifts by tens of percent between minutes, the ratio of
    neighbours is steadier than the ratio of best-ofs taken far apart. Every reader reads one file of
    random bytes written and fsynced before the first round (a file just written, or `dd`'s zeros,
    reads at another speed on this virtual disk); each writer writes its own file, timed to fsync.
    A round runs all the reads, then all the writes, each phase after `--settle` seconds: a read
    right behind a fast write ran into the host's write-back of it."""
    import statistics

    os.makedirs(args.dir, exist_ok=True)
    size, threads = args.size_mb << 20, int(args.threads.split(",")[0])
    path, shared = os.path.join(args.dir, "dd.bin"), os.path.join(args.dir, "read.bin")
    with open(shared, "wb") as f:   # every reader reads this one file: same content, same blocks on disk
        for _ in range(args.size_mb):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())

    def ours(op: str) -> float:
        if op == "write":
            return measure(args.dir, size, 1 << 20, threads, False, 1, direct=True)["GBps"]
        return read_once(shared, size, threads)

    def theirs_dd(op: str) -> float:
        return dd(path if op == "write" else shared, args.size_mb, op == "read")

    def theirs_up(op: str) -> float:
        got = upstream(os.path.join(args.dir, "up.bin"), size, [threads], 1, shared, op)
        return got.get(str(threads), {op: float("nan")})[op]

    runners = {"ours": ours, "dd": theirs_dd, **({} if args.no_upstream else {"upstream": theirs_up})}
    names, ratios = list(runners), {}
    for i in range(args.paired):
        order = names[i % len(names):] + names[:i % len(names)]
        got: dict[str, dict[str, float]] = {name: {} for name in order}
        for op in ("read", "write"):   # all reads, then all writes: no read right behind a write
            time.sleep(args.settle)    # let the host's write-back of the last write drain first
            for name in order:
                got[name][op] = runners[name](op)
        for other in names[1:]:
            for op in ("read", "write"):
                ratios.setdefault((other, op), []).append(got["ours"][op] / got[other][op])
        print(f"round {i} ({' -> '.join(order)}): " + ", ".join(
            f"{n} read {v['read']:.2f} write {v['write']:.2f} GB/s" for n, v in got.items()), flush=True)
    for (other, op), values in ratios.items():
        print(f"{op}: median ratio ours/{other} {statistics.median(values):.2f} over {len(values)} rounds "
              f"(min {min(values):.2f}, max {max(values):.2f}; {threads} threads, direct, {args.size_mb} MiB)",
              flush=True)
    os.remove(path)
    os.remove(shared)


def read_once(path: str, size: int, threads: int) -> float:
    """GB/s of one direct read of `path` by our handle into a `new_cpu_locked_tensor` buffer."""
    import torch

    from deepspeed.ops.aio import aio_handle

    handle = aio_handle(1 << 20, 32, False, True, threads)
    buffer = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))  # host: a dtype example
    buffer.zero_()   # touched, as upstream's buffer is (it is locked): page faults are not timed
    start = time.perf_counter()
    handle.sync_pread(buffer, path)
    seconds = time.perf_counter() - start
    handle.close()
    return size / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/ds_aio_bench")
    p.add_argument("--size_mb", type=int, default=512)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--no_upstream", action="store_true")
    p.add_argument("--settle", type=float, default=3.0,
                   help="--paired: seconds to wait before each round's reads and writes")
    p.add_argument("--paired", type=int, default=0,
                   help="instead: this many rounds of ours (the first --threads count, direct), dd and upstream "
                        "back to back, the order rotated; the median of each round's ratios")
    args = p.parse_args()
    from deepspeed.nvme.io_bench import measure

    if args.paired:
        paired(args, measure)
        return

    os.makedirs(args.dir, exist_ok=True)
    size, threads = args.size_mb << 20, [int(t) for t in args.threads.split(",")]
    path = os.path.join(args.dir, "dd.bin")
    best: dict[str, float] = {}

    def keep(name: str, value: float) -> None:
        best[name] = max(best.get(name, 0.0), value)

    for _ in range(args.loops):   # interleaved: a shared disk's noise hits every configuration alike
        keep("dd write (1 MiB, direct)", dd(path, args.size_mb, False))
        keep("dd read (1 MiB, direct)", dd(path, args.size_mb, True))
        for t in threads:
            for direct in (True, False):
                mode = "direct" if direct else "buffered"
                keep(f"ours write ({t} thr, {mode})", measure(args.dir, size, 1 << 20, t, False, 1, direct=direct)["GBps"])
                keep(f"ours read ({t} thr, {mode})", measure(args.dir, size, 1 << 20, t, True, 1, direct=direct)["GBps"])
    os.remove(path)
    theirs = {} if args.no_upstream else upstream(os.path.join(args.dir, "up.bin"), size, threads, args.loops)
    print(f"# {args.size_mb} MiB per transfer, {args.dir}, best of {args.loops}")
    print(f"{'what':<34}{'GB/s':>8}")
    for name, value in best.items():
        print(f"{name:<34}{value:>8.2f}")
    if "error" in theirs:
        print(f"upstream async_io: {theirs['error']}")
    for t, v in theirs.items() if "error" not in theirs else ():
        print(f"{f'upstream write ({t} thr)':<34}{v['write']:>8.2f}")
        print(f"{f'upstream read ({t} thr)':<34}{v['read']:>8.2f}")


if __name__ == "__main__":
    main()
