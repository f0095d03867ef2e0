"""Peak anonymous resident memory over a call, measured from outside the process (benchmarks, tests).

A sampling thread of the measured process would wait for the GIL while the call runs; a separate
process reads `/proc/<pid>/status` every 0.2 ms instead. Anonymous memory (`RssAnon`) is what a
call really holds: page cache and memory-mapped file pages are reclaimable and not counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


_SAMPLER = """
import select, sys
path, peak = f"/proc/{sys.argv[1]}/status", 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.0002)[0]:
    with open(path) as status:
        peak = max(peak, next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")))
print(peak * 1024, flush=True)
"""


def peak_anon_rise(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result and the largest rise of this process's anonymous resident memory over the call,
    sampled every 0.2 ms by another process (a thread of this one would wait for the GIL)."""
    base = rss_anon()
    sampler = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(os.getpid())], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        if sampler.stdout.readline().strip() != "ready":
            raise RuntimeError("peak_anon_rise: the sampling process did not start")
        out = fn()
        peak = max(int(sampler.communicate("stop\n", timeout=60)[0].strip()), rss_anon())
    finally:
        if sampler.poll() is None:
            sampler.kill()
    return out, peak - base
