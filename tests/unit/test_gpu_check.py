"""tools/gpu/check.sh on CPU (docs/gpu.md): its plumbing must not rot between the sessions that are
lent a GPU. A dry run installs a tiny locally built wheel (no network) into a target dir that is
neither the interpreter's site-packages nor under $OUT, writes results.json and summary.md, and
reports every CUDA step skipped; a wheel folder with nothing for this Python fails the install
step with a message naming both tags; bad arguments are refused before anything runs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tools" / "gpu" / "check.sh"
CUDA_STEPS = ("ds-build", "gpu-tests", "unit-tests", "features", "bench")


def _wheel(folder: Path, name: str, tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel: one module whose import records where it was loaded from."""
    files = {f"{name}/__init__.py": b"VALUE = 42\n",
             f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{name}-0.1.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{name}-0.1.dist-info/RECORD,,\n"
    files[f"{name}-0.1.dist-info/RECORD"] = record.encode()
    path = folder / f"{name}-0.1-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in files.items():
            z.writestr(p, data)
    (folder / "manifest.txt").write_text(f"{name}\n")
    return path


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path / "tmp"), "OUT": str(tmp_path / "out")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, env=env, timeout=120)


def test_dry_run_installs_into_a_target_dir_and_reports_cuda_steps_skipped(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpucheckdummy")
    proc = _check(tmp_path, "--dry-run", "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    status = {s["step"]: (s["status"], s["note"]) for s in results["steps"]}
    assert status == {"env": ("ok", ""), "install": ("ok", ""), "import": ("ok", ""),
                      **{s: ("skipped", "dry run") for s in CUDA_STEPS}}
    assert results["dry_run"] and results["ok"] and results["env"]["python"] == sys.version.split()[0]
    install = results["install"]
    assert install["installed"] == {"gpucheckdummy": "gpucheckdummy-0.1-py3-none-any.whl"}
    assert install["modules"] == ["gpucheckdummy"] and install["deepspeed_wheel"] is None
    # installed into a temporary target (removed at exit), not into this interpreter nor under $OUT
    assert install["target"].startswith(str(tmp_path / "tmp")) and not os.path.exists(install["target"])
    assert not list(out.rglob("gpucheckdummy*"))
    assert subprocess.run([sys.executable, "-c", "import gpucheckdummy"], capture_output=True).returncode != 0
    imported = (out / "import.log").read_text()
    assert "ours: ok" in imported and "gpucheckdummy: ok" in imported and "side-by-side skipped" in imported
    summary = (out / "summary.md").read_text()
    assert "(dry run)" in summary and "| bench | skipped | 0 | dry run |" in summary
    assert {p.name for p in out.iterdir()} >= {"check.log", "steps.jsonl", "env.json", "install.json",
                                               "results.json", "summary.md", "install.log"}


def test_wheels_for_another_python_fail_the_install_step_and_say_so(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpucheckdummy", tag="cp27-cp27mu-manylinux1_x86_64")
    proc = _check(tmp_path, "--dry-run", "--steps", "install", "--wheels", str(wheels), "--bundle")
    assert proc.returncode == 1, proc.stdout + proc.stderr   # --bundle keeps the exit status
    # --bundle: the device tool returns at most 8 files; the step logs travel in one archive
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"check.log", "results.json", "summary.md", "logs.tar.gz"}
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert {"install.log", "install.json", "steps.jsonl"} <= set(archive.getnames())
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(s["step"], s["status"]) for s in results["steps"]] == [("install", "failed")]
    this = f"cp{sys.version_info.major}{sys.version_info.minor}"
    error = results["install"]["error"]
    assert f"tag {this}" in error and "cp27-cp27mu-manylinux1_x86_64" in error and "PY_VERSIONS=" in error
    assert "install: no wheel" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.parametrize("args, message", [(["--steps", "env,bogus"], "unknown step 'bogus'"),
                                           (["--limit", "bench=soon"], "expected step=seconds"),
                                           (["--frobnicate"], "unknown argument '--frobnicate'")])
def test_bad_arguments_are_refused_with_what_is_allowed(tmp_path, args, message):
    proc = _check(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


BENCH = REPO / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_dry_run_reports_rows_and_refuses_unknown_variants(tmp_path):
    """benchmarks/bench_gpu.py --dry-run: a tiny model on the CPU through the same driver, worker
    subprocess and report as on the GPU (DeepSpeed rows are skipped on the CPU)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_GPU_CHECK_DS_PATH": ""}
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--variants", "torch,zero2", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"torch", "zero2"} and all(r["ok"] and r["tokens_per_s"] > 0 for r in rows.values())
    # every timed row is measured twice (--repeats 2), both repeats reported
    assert all(len(r["step_ms_reps"]) == 2 and len(r["tokens_per_s_reps"]) == 2 for r in rows.values())
    assert rows["zero2"]["impl_file"].startswith(str(REPO)) and "| tiny (0.1M) | zero2 |" in result["markdown"]
    assert any("DeepSpeed 0.19.8 rows skipped" in n for n in result["notes"])
    bad = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--variants", "zero9"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown ['zero9']" in bad.stderr


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_labels_deepspeed_rows_with_the_optimizer_the_build_report_allows(tmp_path, monkeypatch):
    """DeepSpeed's ZeRO 0-3 rows use FusedAdam where tools/gpu/ds_build.py built it, else torch_adam with
    the reason in their label; ds-offload is skipped with the reason when its CPU Adam was not built."""
    bench = _load(BENCH, "bench_gpu_under_test")
    report = tmp_path / "ds-build.json"

    def plan(fused, cpu, mode="auto"):
        report.write_text(json.dumps({"fused_adam": fused, "cpu_adam": cpu}))
        return bench.ds_adam_plan(bench.parse_args(["--ds-build", str(report), "--ds-fused-adam", mode]))

    built = {"status": "built", "seconds": 41.0}
    assert plan(built, built) == ("yes", "FusedAdam (built ahead by ds-build in 41.0 s)", None)
    use, label, skip = plan({"status": "no nvcc"}, {"status": "failed", "error": "c++: not found"})
    assert use == "no" and "no nvcc in the image" in label and "c++: not found" in skip
    assert plan({"status": "failed", "error": "x"}, built)[:2] == ("no", "torch_adam: FusedAdam build failed (unfused)")
    assert plan(built, {"status": "not tried"})[2].startswith("skipped: DeepSpeed's CPU Adam was not built")
    assert "did not finish within ds-build's limit" in plan({"status": "unfinished"}, built)[1]
    assert plan(built, built, "no")[0] == "no"
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)   # no report, no nvcc
    no_report = bench.ds_adam_plan(bench.parse_args(["--ds-build", str(tmp_path / "absent.json")]))
    assert no_report == ("no", "torch_adam: no nvcc on this machine, so no FusedAdam (unfused)", None)


def test_feature_rows_train_on_the_cpu_and_the_comparison_flags_what_differs():
    """Every feature row of tools/gpu/features.py (ZeRO-3, offload, SP, ALST, AutoTP, MoE, Muon, ZeRO++)
    trains here in-process for 2 steps (world size 1, gloo); evaluate() passes equal runs, and flags a
    loss outside the tolerance, a device run that was not on cuda/nccl, and a side that failed."""
    import torch

    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    try:
        rows_mod = _load(REPO / "tools" / "gpu" / "feature_rows.py", "feature_rows")
        features = _load(REPO / "tools" / "gpu" / "features.py", "gpu_features_under_test")
    finally:
        sys.path.remove(str(REPO / "tools" / "gpu"))
    runs = {name: {"ok": True, **rows_mod.run_row(name, torch.device("cpu"), 2)} for name in rows_mod.ROWS}
    assert set(runs) >= {"zero3", "zero3-offload-optimizer", "zero3-offload-param", "sp-ulysses", "sp-alst",
                         "tp-autotp", "moe", "muon", "zeropp"}
    assert all(len(r["losses"]) == 2 and r["world_size"] == 1 and r["backend"] == "gloo" for r in runs.values())
    assert "MuonWithAuxAdam" in runs["muon"]["notes"] and "DeepSpeedCPUAdam" in runs["zero3-offload-param"]["notes"]
    assert len(runs["zeropp"]["probe"]) == 3 and "AutoTP plan column" in runs["tp-autotp"]["notes"]
    names = list(runs)
    assert all(r["ok"] for r in features.evaluate(names, runs, runs, rehearsal=True))
    # on a device machine a run on the CPU/gloo is not the device run
    assert not any(r["ok"] for r in features.evaluate(names, runs, runs, rehearsal=False))
    off = {**runs, "zero3": {**runs["zero3"], "losses": [v * 1.05 for v in runs["zero3"]["losses"]]}}
    table = {r["row"]: r for r in features.evaluate(names, off, runs, rehearsal=True)}
    assert not table["zero3"]["ok"] and table["zero3"]["verdict"].startswith("MISMATCH")
    assert table["moe"]["ok"]
    failed = {**runs, "muon": {"row": "muon", "ok": False, "error": "RuntimeError: boom"}}
    table = {r["row"]: r for r in features.evaluate(names, failed, runs, rehearsal=True)}
    assert table["muon"]["verdict"] == "FAILED: device: RuntimeError: boom"
    assert "| muon | bf16 | - |" in features.markdown(list(table.values()), "cpu", 2, True)


@pytest.mark.slow   # ~1-2 minutes on 2 busy cores: worker processes for both sides, then the bench workers
def test_cpu_rehearsal_runs_the_feature_rows_and_the_repeated_bench_rows(tmp_path):
    """check.sh --cpu-rehearsal: the features step trains every row on both sides (the CPU standing in
    for the device) and compares them; the bench measures each row twice; --bundle packs the logs."""
    proc = _check(tmp_path, "--cpu-rehearsal", "--steps", "env,ds-build,features,bench", "--bundle")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    status = {s["step"]: (s["status"], s["note"]) for s in results["steps"]}
    assert status == {"env": ("ok", ""), "ds-build": ("skipped", "no DeepSpeed wheel"), "features": ("ok", ""),
                      "bench": ("ok", "")}
    rows = results["features"]["rows"]
    assert results["features"]["rehearsal"] and len(rows) == 10 and all(r["ok"] for r in rows)
    assert all(len(r["step_ms_reps"]) == 2 for r in results["bench"]["rows"])
    summary = (out / "summary.md").read_text()
    assert "features on CPU rehearsal" in summary and "| zeropp | bf16 |" in summary
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert {"features.json", "features-workers.log", "bench-workers.log"} <= set(archive.getnames())
