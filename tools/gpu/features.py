"""Feature rows on one GPU against the same run on the CPU (the `features` step of tools/gpu/check.sh).

    python tools/gpu/features.py --json OUT/features.json --log OUT/features-workers.log
    python tools/gpu/features.py --cpu-rehearsal      # both runs on the CPU (gloo): the plumbing only
    python tools/gpu/features.py --rows zero3,muon --steps 3

Each row (tools/gpu/feature_rows.py: ZeRO-3, ZeRO-3 with offload_optimizer / offload_param cpu,
Ulysses SP, ALST, AutoTP, MoE, Muon, ZeRO++) trains a tiny causal LM for a few steps at world
size 1: once in a worker on the device (NCCL process group of one rank), once in a worker that
sees no GPU (CUDA_VISIBLE_DEVICES="", gloo), from the same seeds and tokens; the row passes when
every step's loss (and the row's probe values) agree within the row's tolerance (bf16: rtol 2e-2,
atol 1e-3; fp32: rtol 1e-3, atol 1e-4). The two workers run at the same time on a device machine
and one after the other in a rehearsal. A row that raises is reported with its error; a worker
that dies or hangs is restarted after the row it was in.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from feature_rows import ROWS, TOLERANCE, compare  # noqa: E402


def worker(args) -> int:
    import torch

    import deepspeed

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("features worker: --device cuda without a CUDA device")
    if cuda:
        torch.cuda.set_device(0)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    from feature_rows import run_row

    with open(args.out, "a") as out:
        for name in args.rows.split(","):
            out.write(json.dumps({"started": name}) + "\n")
            out.flush()
            t0 = time.monotonic()
            try:
                rec = {"row": name, "ok": True, **run_row(name, device, args.steps)}
            except Exception as e:   # report it, go on with the next row
                import traceback

                traceback.print_exc()
                rec = {"row": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
            rec["seconds"] = round(time.monotonic() - t0, 1)
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> tuple[dict[str, dict], str | None]:
    done, started = {}, None
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            if "started" in rec:
                started = rec["started"]
            else:
                done[rec["row"]] = rec
                started = None
    return done, started


def _start(args, side: str, rows: list[str], out: str, logf) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["MASTER_PORT"] = str(_free_port())
    device = "cpu" if side == "cpu" or args.cpu_rehearsal else "cuda"
    if side == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""   # the accelerator is then the CPU, the backend gloo
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", device, "--rows", ",".join(rows),
           "--steps", str(args.steps), "--out", out]
    logf.write(f"--- {side} worker ({device}): {','.join(rows)}\n")
    logf.flush()
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_side(args, side: str, rows: list[str], deadline: float, logf, tmp: str) -> dict[str, dict]:
    """Every row of `rows` on one side; a worker that dies or hangs is restarted after its row."""
    out = os.path.join(tmp, f"{side}.jsonl")
    todo, results = list(rows), {}
    while todo:
        if deadline - time.monotonic() < 3:
            results.update({r: {"row": r, "ok": False, "error": "skipped: --budget spent"} for r in todo})
            break
        proc = _start(args, side, todo, out, logf)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        done, hung = _read(out)
        if hung is not None:
            done[hung] = {"row": hung, "ok": False, "error": "timeout" if deadline - time.monotonic() < 3 else
                          f"worker died (exit {proc.returncode}; see the log)"}
            with open(out, "a") as f:
                f.write(json.dumps(done[hung]) + "\n")
        elif not any(r in done for r in todo):
            done.update({r: {"row": r, "ok": False, "error": f"worker failed to start (exit {proc.returncode})"}
                         for r in todo})
        results.update({r: done[r] for r in todo if r in done})
        todo = [r for r in todo if r not in done]
    return results


def _side_pair(args, rows: list[str], logf) -> tuple[dict, dict]:
    """The device side and the CPU side: at once on a device machine, one after the other in a rehearsal."""
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory() as tmp:
        if args.cpu_rehearsal:
            split = time.monotonic() + args.budget / 2
            dev = run_side(args, "device", rows, split, logf, tmp)
            return dev, run_side(args, "cpu", rows, deadline, logf, tmp)
        import threading

        box: dict = {}
        thread = threading.Thread(target=lambda: box.update(cpu=run_side(args, "cpu", rows, deadline, logf, tmp)))
        thread.start()
        dev = run_side(args, "device", rows, deadline, logf, tmp)
        thread.join()
        return dev, box["cpu"]


def evaluate(rows: list[str], dev: dict, cpu: dict, rehearsal: bool) -> list[dict]:
    table = []
    for name in rows:
        d, c = dev.get(name, {}), cpu.get(name, {})
        rec = {"row": name, "dtype": ROWS[name]["dtype"], "tolerance": TOLERANCE[ROWS[name]["dtype"]],
               "device_run": d, "cpu_run": c}
        if not d.get("ok") or not c.get("ok"):
            rec.update(ok=False, verdict="FAILED: " + "; ".join(f"{side}: {r.get('error', 'not run')}"
                                                                 for side, r in (("device", d), ("cpu", c))
                                                                 if not r.get("ok")))
        else:
            ok, worst, text = compare(name, d, c)
            wrong_place = (not rehearsal) and (not d["device"].startswith("cuda") or d["backend"] != "nccl")
            if wrong_place:
                ok, text = False, f"device run on {d['device']}/{d['backend']}, not cuda/nccl; {text}"
            rec.update(ok=ok, worst=worst, verdict=("ok: " if ok else "MISMATCH: ") + text)
        table.append(rec)
    return table


def markdown(table: list[dict], device: str, steps: int, rehearsal: bool) -> str:
    what = "CPU rehearsal: both sides on the CPU (gloo)" if rehearsal else f"{device} (NCCL) vs CPU (gloo)"
    lines = [f"features on {what}, world size 1, {steps} steps per row", "",
             "| row | dtype | device losses | CPU losses | verdict | s (device / CPU) | what ran |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        d, c = r["device_run"], r["cpu_run"]
        fmt = (lambda run: " ".join(f"{v:.4f}" for v in run.get("losses", [])) or "-")  # noqa: E731
        lines.append(f"| {r['row']} | {r['dtype']} | {fmt(d)} | {fmt(c)} | {r['verdict']} | "
                     f"{d.get('seconds', '-')} / {c.get('seconds', '-')} | {d.get('notes') or ROWS[r['row']]['why']} |")
    return "\n".join(lines) + "\n"


def driver(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_rehearsal:
        print("features: no CUDA device (use --cpu-rehearsal for the CPU plumbing check)", file=sys.stderr)
        return 2
    rows = args.rows.split(",") if args.rows else list(ROWS)
    device = torch.cuda.get_device_name() if cuda and not args.cpu_rehearsal else "cpu"
    with open(args.log or os.devnull, "a") as logf:
        dev, cpu = _side_pair(args, rows, logf)
    table = evaluate(rows, dev, cpu, args.cpu_rehearsal)
    text = markdown(table, device, args.steps, args.cpu_rehearsal)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rehearsal": args.cpu_rehearsal, "steps": args.steps, "rows": table,
                       "markdown": text}, f, indent=1)
    return 0 if all(r["ok"] for r in table) else 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help=f"comma-separated (default all): {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=float, default=120, help="seconds for both sides; the rest is reported skipped")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="the device side on the CPU too (gloo)")
    ap.add_argument("--json", default="")
    ap.add_argument("--log", default="", help="the workers' output (default: discarded)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r and r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; allowed: {', '.join(ROWS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
