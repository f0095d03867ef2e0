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
CUDA_STEPS = ("gpu-tests", "unit-tests", "bench")


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
    assert rows["zero2"]["impl_file"].startswith(str(REPO)) and "| tiny (0.1M) | zero2 |" in result["markdown"]
    assert any("DeepSpeed 0.19.8 rows skipped" in n for n in result["notes"])
    bad = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--variants", "zero9"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown ['zero9']" in bad.stderr
