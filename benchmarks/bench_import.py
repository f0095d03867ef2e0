"""Time `import deepspeed` after torch is imported: median over N fresh interpreters.

    python benchmarks/bench_import.py --runs 15 [--chain deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES]

Each run starts a new Python, imports torch (untimed), then times `import deepspeed` (and, with
--chain, the first resolution of that attribute chain, timed separately). It also lists which
heavy modules the bare import pulled in (none expected: everything below is lazy, PEP 562).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import json, sys, time
import torch
before = set(sys.modules)
t0 = time.perf_counter()
import deepspeed
t1 = time.perf_counter()
new = sorted(m for m in set(sys.modules) - before)
chain_s = None
if sys.argv[1]:
    t2 = time.perf_counter(); eval(sys.argv[1]); chain_s = time.perf_counter() - t2
heavy = [m for m in ("pydantic", "deepspeed.runtime.engine", "deepspeed.runtime.config", "tqdm") if m in new]
print(json.dumps({"import_s": t1 - t0, "chain_s": chain_s, "new_modules": len(new), "heavy": heavy}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--chain", default="", help="an attribute chain to resolve after the import (timed apart)")
    a = p.parse_args()
    rows = [json.loads(subprocess.run([sys.executable, "-c", PROBE, a.chain], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(a.runs)]
    imp = sorted(r["import_s"] for r in rows)
    print(f"import deepspeed after torch: median {statistics.median(imp) * 1e3:.1f} ms "
          f"(min {imp[0] * 1e3:.1f}, max {imp[-1] * 1e3:.1f}) over {a.runs} fresh interpreters; "
          f"{rows[0]['new_modules']} new modules, heavy: {rows[0]['heavy'] or 'none'}")
    if a.chain:
        ch = sorted(r["chain_s"] for r in rows)
        print(f"first `{a.chain}`: median {statistics.median(ch) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
