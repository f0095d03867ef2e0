"""Build DeepSpeed 0.19.8's FusedAdam (CUDA, needs nvcc) and CPU Adam (C++) ops ahead of the benchmark.

    python tools/gpu/ds_build.py --report OUT/ds-build.json [--dry-run]

tools/gpu/check.sh starts it in the background once the wheels are installed, with
PYTHONPATH=$DS_GPU_CHECK_DS_PATH (DeepSpeed's dirs only), a working directory outside the
repository and TORCH_EXTENSIONS_DIR shared with benchmarks/bench_gpu.py, so the builds overlap the
test steps and the benchmark's DeepSpeed rows load the built ops instead of JIT-building them
inside their time budget. FusedAdam is built only when `nvcc` is on PATH (else the report says
so and bench_gpu.py labels DeepSpeed's rows torch_adam); CPU Adam needs the host compiler and the
ninja binary from the wheels. `--dry-run` (the CPU rehearsal) imports DeepSpeed and reports what
it would build, building nothing. The report: {"deepspeed": version/file, "nvcc": path,
"fused_adam": {"status": built|failed|unfinished|no nvcc|not tried, "seconds", "error"}, "cpu_adam": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


def _build(builder_name: str, dry_run: bool) -> dict:
    if dry_run:
        return {"status": "not tried (dry run)"}
    t0 = time.monotonic()
    try:
        from deepspeed.ops import op_builder

        getattr(op_builder, builder_name)().load(verbose=False)
    except KeyboardInterrupt:   # check.sh's timeout sends SIGINT at the step's limit
        return {"status": "unfinished", "seconds": round(time.monotonic() - t0, 1),
                "error": "interrupted at the step's limit"}
    except BaseException as e:   # a compiler error, SystemExit from a builder
        return {"status": "failed", "seconds": round(time.monotonic() - t0, 1),
                "error": f"{type(e).__name__}: {e}"[-400:]}
    return {"status": "built", "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    report = {"nvcc": nvcc, "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
              "fused_adam": {"status": "not tried"}, "cpu_adam": {"status": "not tried"}}

    def write() -> None:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)

    try:
        import deepspeed

        report["deepspeed"] = {"version": deepspeed.__version__, "file": deepspeed.__file__}
        if deepspeed.__version__ != "0.19.8":
            report["error"] = f"imported deepspeed {deepspeed.__version__} from {deepspeed.__file__}, not 0.19.8"
            write()
            return 1
    except Exception as e:
        report["error"] = f"import deepspeed: {type(e).__name__}: {e}"
        write()
        return 1
    write()
    for key, builder in (("fused_adam", "FusedAdamBuilder"), ("cpu_adam", "CPUAdamBuilder")):
        if key == "fused_adam" and nvcc is None:
            report[key] = {"status": "no nvcc"}
            continue
        report[key] = {"status": "unfinished"}   # what the report says if the step's limit kills the build
        write()
        report[key] = _build(builder, args.dry_run)
        write()
        if report[key]["status"] == "unfinished":
            return 1
    print(json.dumps(report))
    return 0 if all(report[k]["status"] != "failed" for k in ("fused_adam", "cpu_adam")) else 1


if __name__ == "__main__":
    sys.exit(main())
