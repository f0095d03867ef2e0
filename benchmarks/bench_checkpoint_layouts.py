"""What a change of layout costs at load time (issue 39 item 5): ours loads another layout's checkpoint
directly; DeepSpeed 0.19.8 needs `ds_to_universal` first, then `checkpoint.load_universal`.

    python benchmarks/bench_checkpoint_layouts.py [--impls ours,ds] [--hidden 512 --vocab 4096 --blocks 4]

The model and the jobs are tools/universal_interop/worker.py's (public DeepSpeed API only, so the same file
runs with either package): a small LM with a fused gate/up weight cut block by block under AutoTP, AdamW,
fp32, gloo, 1 thread per rank. Each saving job trains 2 steps at the source layout and saves; each loading
job is a fresh set of processes at the target layout that times `load_checkpoint` (the slowest rank's
wall and CPU seconds, and the largest growth of a rank's peak RSS during the load, measured by resetting
the kernel's high-water mark first) and then trains 2 more steps, whose losses are compared with the
uninterrupted run at the target layout (the same check as the interop tool). The universal route's
converter is timed separately under /usr/bin/time (wall, CPU, its peak RSS).

Cases (source -> target; 2 ranks unless the target says dp1): same layout (dp2, tp2), data size (dp2 ->
dp1), ZeRO stage (1 -> 3 at dp2) and tensor-parallel size (tp2 -> tp1 x dp2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "universal_interop"))
from run import job, rel, run  # noqa: E402

CASES = {   # name: (source layout, target layout); a layout is (world, tp, ZeRO stage)
    "same dp2 z1": ((2, 1, 1), (2, 1, 1)),
    "same tp2 z1": ((2, 2, 1), (2, 2, 1)),
    "dp2 -> dp1": ((2, 1, 1), (1, 1, 1)),
    "z1 -> z3 (dp2)": ((2, 1, 1), (2, 1, 3)),
    "tp2 -> tp1 x dp2": ((2, 2, 1), (2, 1, 1)),
}


def convert_timed(impl: str, venv: str, scratch: str, ckpt: str, tag: str) -> dict:
    """ds_to_universal of ckpt/tag into ckpt/<tag>_universal (and `latest_universal`), under /usr/bin/time."""
    out = os.path.join(ckpt, f"{tag}_universal")
    shutil.rmtree(out, ignore_errors=True)
    rc, text = run(impl, venv, scratch, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                         os.path.join(ckpt, tag), "--output_folder", out],
                   timeout=1800, wrap=["/usr/bin/time", "-f", "TIME %e %U %S %M"])
    lines = [line.split() for line in text.splitlines() if line.startswith("TIME ")]
    if rc or not lines:
        return {"error": " | ".join(text.strip().splitlines()[-3:])}
    wall, user, system, kib = map(float, lines[-1][1:])
    with open(os.path.join(ckpt, "latest_universal"), "w") as f:
        f.write(f"{tag}_universal")
    return {"wall": wall, "cpu": user + system, "peak_mib": kib / 1024}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="ours,ds")
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench_ckpt_layouts_")
    scratch = os.path.join(work, "cwd")
    os.makedirs(scratch, exist_ok=True)
    size = {"hidden": args.hidden, "vocab": args.vocab, "blocks": args.blocks, "optimizer": "adamw"}
    params = 2 * args.vocab * args.hidden + 2 * args.hidden + args.blocks * (
        args.hidden * 8 * args.hidden + 8 * args.hidden + 4 * args.hidden * args.hidden + args.hidden)
    print(f"# model: {params / 1e6:.1f}M parameters (hidden {args.hidden}, vocab {args.vocab}, {args.blocks} blocks), "
          f"AdamW fp32; costs are the slowest rank's; peak = growth of a rank's peak RSS during the load", flush=True)
    print("| case | impl | route | convert wall / CPU s | convert peak MiB | load wall / CPU s | load peak MiB | "
          "continued losses vs uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.cases.split(","):
        (sw, stp, sst), (tw, ttp, tst) = CASES[name]
        want = job("ours", args.ds_venv, scratch, ckpt=work, world=tw, tp=ttp, stage=tst, steps=4, start=0, **size)
        for impl in args.impls.split(","):
            runner = "upstream" if impl == "ds" else "ours"
            ckpt = os.path.join(work, impl + "_" + "".join(c if c.isalnum() else "_" for c in name))
            shutil.rmtree(ckpt, ignore_errors=True)
            saved = job(runner, args.ds_venv, scratch, ckpt=ckpt, world=sw, tp=stp, stage=sst, steps=2, start=0,
                        save="t", **size)
            same = (sw, stp, sst) == (tw, ttp, tst)
            routes = ["plain"] + ([] if same else ["universal"]) if impl == "ours" else ["plain" if same else "universal"]
            for route in routes:
                row = {"case": name, "impl": "ours" if impl == "ours" else "DeepSpeed 0.19.8", "route": route}
                conv = convert_timed(runner, args.ds_venv, scratch, ckpt, "t") if route == "universal" and \
                    "error" not in saved else {}
                got = saved if "error" in saved else conv if "error" in conv else job(
                    runner, args.ds_venv, scratch, ckpt=ckpt, world=tw, tp=ttp, stage=tst, steps=2, start=2,
                    load=route, tag="t_universal" if route == "universal" else "t", measure=True, **size)
                if "error" in got:
                    row["error"] = got["error"][:300]
                    print(f"| {name} | {row['impl']} | {route} | error: {row['error']} |||||", flush=True)
                else:
                    wall, cpu, peak = got["load_cost"]
                    row.update(convert=conv, load={"wall": wall, "cpu": cpu, "peak_mib": peak},
                               max_rel=rel(got["losses"], want["losses"][2:]))
                    c = f"{conv['wall']:.2f} / {conv['cpu']:.2f} | {conv['peak_mib']:.0f}" if conv else "- | -"
                    print(f"| {name} | {row['impl']} | {route} | {c} | {wall:.2f} / {cpu:.2f} | {peak:.0f} | "
                          f"max rel {row['max_rel']:.1e} |", flush=True)
                rows.append(row)
    print("SUMMARY " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
