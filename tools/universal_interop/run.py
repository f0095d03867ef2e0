"""Universal checkpoints between this package and DeepSpeed 0.19.8, both directions, on CPU (2 ranks, gloo).

    python tools/universal_interop/run.py [--ds-venv /tmp/ds-venv] [--work /tmp/univ_interop]

For each optimizer (AdamW, SGD with momentum) and each writer (ours, DeepSpeed's):
  1. the writer trains the TP=2 AutoTP model of worker.py 2 steps at ZeRO-1 and saves it;
  2. the writer's own ds_to_universal converts it;
  3. each reader (ours, DeepSpeed's) loads it with checkpoint.load_universal at TP=1 x DP=2 (and TP=2)
     and trains 2 more steps;
  4. the continued losses are compared with our uninterrupted 4 steps at the same layout.
Prints one line per case and a JSON summary. Runs outside the repository for DeepSpeed (a scratch cwd, no
PYTHONPATH, a private TORCH_EXTENSIONS_DIR) and removes DeepSpeed's /dev/shm buffers afterwards."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def _env(impl: str, venv: str, scratch: str) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if impl == "ours":
        env["PYTHONPATH"] = ROOT
        return sys.executable, env
    ext = os.path.join(scratch, "torch_extensions")
    if not os.path.isdir(ext) and os.path.isdir(os.path.join(venv, "torch_extensions")):
        shutil.copytree(os.path.join(venv, "torch_extensions"), ext, ignore=shutil.ignore_patterns("lock"))
    env["TORCH_EXTENSIONS_DIR"] = ext
    return os.path.join(venv, "bin", "python"), env


def run(impl: str, venv: str, scratch: str, args: list[str], timeout: float = 300,
        wrap: tuple | list = ()) -> tuple[int, str]:
    python, env = _env(impl, venv, scratch)
    proc = subprocess.Popen([*wrap, python, *args], env=env, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\ntimed out after {timeout} s"
        proc.returncode = proc.returncode or 124
    for f in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            os.remove(f)
        except OSError:
            pass
    return proc.returncode, output


def job(impl: str, venv: str, scratch: str, timeout: float = 900, **spec) -> dict:
    rc, out = run(impl, venv, scratch, [WORKER, json.dumps(spec)], timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if rc or not lines:
        return {"error": " | ".join(out.strip().splitlines()[-4:])}
    return json.loads(lines[-1][len("RESULT "):])


def convert(impl: str, venv: str, scratch: str, ckpt: str) -> str:
    rc, out = run(impl, venv, scratch, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                        os.path.join(ckpt, "tp"), "--output_folder", os.path.join(ckpt, "tp_universal")])
    if rc == 0:
        with open(os.path.join(ckpt, "latest_universal"), "w") as f:
            f.write("tp_universal")
        return "ok"
    return " | ".join(out.strip().splitlines()[-3:])


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def report(summary: list, case: dict, label: str) -> None:
    """Add `case` to `summary` and print its line."""
    summary.append(case)
    print(f"{label}: " + (f"max rel diff {case['max_rel']:.2e} (losses {case['losses']})" if "max_rel" in case
                          else f"FAILED: {case['error'][:400]}"), flush=True)


def setup(description: str, option: str, default: str, prefix: str) -> tuple[argparse.Namespace, str, str]:
    """(arguments: --ds-venv, --work and `option`; the work directory; its scratch cwd, created)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    parser.add_argument("--work", default=None)
    parser.add_argument(option, default=default)
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix=prefix)
    scratch = os.path.join(work, "cwd")
    os.makedirs(scratch, exist_ok=True)
    return args, work, scratch


def main() -> int:
    args, work, scratch = setup(__doc__.split("\n")[0], "--optimizers", "adamw,sgd", "univ_interop_")
    summary = []
    for opt in args.optimizers.split(","):
        want = {tp: job("ours", args.ds_venv, scratch, ckpt=work, tp=tp, stage=1, steps=4, start=0, optimizer=opt)
                for tp in (1, 2)}
        for writer in ("ours", "upstream"):
            ckpt = os.path.join(work, f"{opt}_{writer}")
            shutil.rmtree(ckpt, ignore_errors=True)
            saved = job(writer, args.ds_venv, scratch, ckpt=ckpt, tp=2, stage=1, steps=2, start=0, optimizer=opt,
                        save="tp")
            status = "error" in saved and saved["error"] or convert(writer, args.ds_venv, scratch, ckpt)
            for reader in ("ours", "upstream"):
                for tp in (1, 2):
                    case = {"optimizer": opt, "written_by": writer, "loaded_by": reader, "tp": tp}
                    if status != "ok":
                        case["error"] = f"save/convert: {status}"
                    else:
                        got = job(reader, args.ds_venv, scratch, ckpt=ckpt, tp=tp, stage=1, steps=2, start=2,
                                  optimizer=opt, load="universal")
                        if "error" in got:
                            case["error"] = got["error"]
                        else:
                            case.update(losses=got["losses"], want=want[tp]["losses"][2:],
                                        max_rel=rel(got["losses"], want[tp]["losses"][2:]))
                    report(summary, case, f"{opt:6s} written by {writer:8s} loaded by {reader:8s} at TP={tp}")
    print("SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
