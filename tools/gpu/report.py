"""The Python side of tools/gpu/check.sh: probe the environment, check imports, and gather the
steps' results into results.json and summary.md.

    python tools/gpu/report.py env --out OUT/env.json
    python tools/gpu/report.py imports --repo REPO --install OUT/install.json --ds-path DSDIR:DEPSDIR
    python tools/gpu/report.py summary --out OUT --dry-run 0|1      # exit 1 when a step failed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET


def env(out: str) -> int:
    import torch

    info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda": torch.cuda.is_available(), "nvcc": shutil.which("nvcc"), "cuda_home": os.environ.get("CUDA_HOME")}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None)
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15)
            info["nvidia_smi"] = smi.stdout.strip()
        except subprocess.TimeoutExpired:
            info["nvidia_smi"] = "nvidia-smi -L timed out"
    with open(out, "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))
    return 0


def _probe(code: str, path: str, cwd: str | None = None) -> dict:
    """Run `code` in a fresh interpreter with PYTHONPATH=path; its last stdout line is JSON."""
    envv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    envv["PYTHONPATH"] = path
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envv, cwd=cwd)
    if proc.returncode:
        return {"ok": False, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}


def imports(repo: str, install: str, ds_path: str) -> int:
    """This package with the installed wheels; every installed module from the target dir; and
    DeepSpeed 0.19.8 alone from its own dir, in a process started outside the repository (a
    working directory of the repo would put our `deepspeed` first on sys.path)."""
    rep = json.load(open(install)) if os.path.isfile(install) else {}
    target = rep.get("target", "")
    path = os.environ.get("PYTHONPATH", "")
    results, ok = {}, True
    ours = _probe("import json, deepspeed, pydantic, torch; print(json.dumps({'file': deepspeed.__file__, "
                  "'version': deepspeed.__version__, 'pydantic': pydantic.VERSION}))", path)
    ours_ok = ours["ok"] and os.path.realpath(ours["file"]).startswith(os.path.realpath(repo))
    results["ours"], ok = ours, ok and ours_ok
    modules = rep.get("modules", [])
    code = ("import importlib, json; r = {}\nfor n in %r:\n    try:\n        m = importlib.import_module(n)\n"
            "        r[n] = getattr(m, '__file__', None) or str(list(m.__path__))\n    except Exception as e:\n"
            "        r[n] = 'ERROR ' + repr(e)\nprint(json.dumps({'files': r}))" % (modules,))
    files = _probe(code, path).get("files", {})
    for module in modules:
        file = files.get(module, "not probed")
        results[module] = {"ok": bool(target) and target in file, "file": file}
        ok = ok and results[module]["ok"]
    if rep.get("deepspeed_wheel"):
        with tempfile.TemporaryDirectory() as cwd:
            ds = _probe("import json, deepspeed; print(json.dumps({'file': deepspeed.__file__, "
                        "'version': deepspeed.__version__}))", ds_path, cwd=cwd)
        results["deepspeed_0.19.8"] = ds
        ok = ok and ds["ok"] and ds.get("version") == "0.19.8"
    else:
        results["deepspeed_0.19.8"] = {"ok": None, "note": "no DeepSpeed wheel installed: side-by-side skipped"}
    for name, r in results.items():
        print(f"{name}: {'ok' if r.get('ok') else r}")
    return 0 if ok else 1


def _junit(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    counts["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None][:30]
    return counts


def summary(out: str, dry_run: bool) -> int:
    steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl")) if line.strip()]
    load = lambda name: json.load(open(p)) if os.path.isfile(p := os.path.join(out, name)) else None  # noqa: E731
    envi, install, bench = load("env.json"), load("install.json"), load("bench.json")
    features, ds_build = load("features.json"), load("ds-build.json")
    tests = {s["step"]: _junit(os.path.join(out, f"{s['step']}.xml")) for s in steps if s["step"].endswith("tests")}
    bad = [s["step"] for s in steps if s["status"] in ("failed", "timeout")]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "dry_run": dry_run, "ok": not bad, "env": envi, "steps": steps, "install": install,
               "tests": tests, "features": features, "ds_build": ds_build, "bench": bench}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    device = (envi or {}).get("device") or "no CUDA device"
    lines = [f"# gpu-check {results['date']}{' (dry run)' if dry_run else ''}", "",
             f"device: {device}; python {(envi or {}).get('python', '?')}, torch {(envi or {}).get('torch', '?')} "
             f"(CUDA {(envi or {}).get('torch_cuda')}), nvcc: {(envi or {}).get('nvcc') or 'none'}", "",
             "| step | status | seconds | note |", "|---|---|---|---|"]
    for s in steps:
        t = tests.get(s["step"])
        note = s["note"]
        if t:
            note = (f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
                    + (f"; {note}" if note else ""))
        for name, rep, key in (("features", features, "row"), ("bench", bench, "variant")):
            if s["step"] == name and rep and rep.get("rows"):
                bad_rows = [r.get(key, "?") for r in rep["rows"] if not r.get("ok")]
                note = (f"{len(rep['rows']) - len(bad_rows)} of {len(rep['rows'])} rows ok"
                        + (f" (not: {', '.join(bad_rows)})" if bad_rows else "") + (f"; {note}" if note else ""))
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']:.0f} | {note} |")
    if install and install.get("error"):
        lines += ["", f"install: {install['error']}"]
    for name, t in tests.items():
        if t and t["failed_tests"]:
            lines += ["", f"{name} failures:", *[f"- `{n}`" for n in t["failed_tests"]]]
    if ds_build:
        lines += ["", "ds-build (DeepSpeed 0.19.8 ops for the bench): " + "; ".join(
            f"{op} {ds_build.get(op, {}).get('status')}" + (f" in {ds_build[op]['seconds']} s"
                                                           if ds_build.get(op, {}).get("seconds") else "")
            for op in ("fused_adam", "cpu_adam")) + f"; nvcc {ds_build.get('nvcc') or 'none'}"
            + (f"; error: {ds_build['error']}" if ds_build.get("error") else "")]
    if features and features.get("markdown"):
        lines += ["", features["markdown"]]
    if bench and bench.get("markdown"):
        lines += ["", bench["markdown"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--out", required=True)
    i = sub.add_parser("imports")
    i.add_argument("--repo", required=True)
    i.add_argument("--install", required=True)
    i.add_argument("--ds-path", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--out", required=True)
    s.add_argument("--dry-run", type=int, choices=(0, 1), default=0)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        return env(args.out)
    if args.cmd == "imports":
        return imports(args.repo, args.install, args.ds_path)
    return summary(args.out, bool(args.dry_run))


if __name__ == "__main__":
    sys.exit(main())
