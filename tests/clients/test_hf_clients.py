"""Hugging Face clients run unchanged on this deepspeed: Trainer and Accelerate, 2 ranks on CPU.

Each test launches one worker (two ranks) that runs several variants in turn and checks, per
variant: the loss falls; resuming from the step-10 checkpoint reproduces steps 11-20 (losses,
learning rates, final fp32 weights); the saved final weights (a 16-bit gather under ZeRO-3)
reload with `from_pretrained` with no missing keys and give the same eval loss; zero_to_fp32
rebuilds those weights. Models are built from a config (tiny Llama) and data made in the test:
nothing is downloaded. See tests/clients/hf_common.py and /work/shared/HF_SURFACE.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 540


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(console_script: str, module: list[str]) -> list[str]:
    """The console script installed beside this interpreter, else the same entry point via -m."""
    path = os.path.join(os.path.dirname(sys.executable), console_script)
    return [path] if os.access(path, os.X_OK) else [sys.executable, *module]


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-8000:]
    return json.loads(lines[-1][len("RESULT "):])


def run_under_deepspeed_launcher(worker: str, out, variants: list[str], ranks: int = 2) -> dict:
    """`deepspeed --num_gpus RANKS worker --out OUT --variants a,b,...`: the worker's RESULT dict."""
    cmd = _command("deepspeed", ["-m", "deepspeed.launcher.runner"]) + [
        "--num_gpus", str(ranks), "--master_port", str(_free_port()),
        os.path.join(HERE, worker), "--out", str(out), "--variants", ",".join(variants)]
    result = _run(cmd)
    assert sorted(result) == sorted(variants)
    return result


def _accelerate_launch(out, variants: list[str]) -> dict:
    """`accelerate launch --use_deepspeed ... hf_accelerate_worker.py --variants ...`: its RESULT dict."""
    cmd = _command("accelerate", ["-m", "accelerate.commands.launch"])
    if cmd[0] != sys.executable:
        cmd.append("launch")
    cmd += ["--use_deepspeed", "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0",
            "--main_process_port", str(_free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
            os.path.join(HERE, "hf_accelerate_worker.py"), "--out", str(out), "--variants", ",".join(variants)]
    result = _run(cmd)
    assert set(result) == set(variants)
    return result


def test_trainer_zero2_zero3_under_deepspeed_launcher(tmp_path):
    """`deepspeed --num_gpus 2 worker.py`: Trainer with a json config; ZeRO-2 and ZeRO-3 with
    DeepSpeed's AdamW + WarmupDecayLR (fp32), ZeRO-3 bf16 with Trainer's optimizer and scheduler."""
    result = run_under_deepspeed_launcher("hf_trainer_worker.py", tmp_path, ["z2", "z3", "z3bf16hf"])
    for name, r in result.items():
        assert len(r["losses"]) == 20 and r["losses"][-1] < r["losses"][0], name


def test_accelerate_plugin_zero2_zero3_under_accelerate_launch(tmp_path):
    """`accelerate launch --use_deepspeed`: manual loop with save_state/load_state; ZeRO-2 with a
    torch optimizer and HF scheduler, ZeRO-3 with DummyOptim/DummyScheduler and zero3_init_flag."""
    result = _accelerate_launch(tmp_path, ["z2", "z3"])
    for name, r in result.items():
        assert len(r["losses"]) == 20 and r["losses"][-1] < r["losses"][0], name


@pytest.mark.slow   # another launch of the Trainer worker
def test_trainer_zero3_nvme_offload_under_deepspeed_launcher(tmp_path):
    """Trainer with a json config carrying the transformers docs' ZeRO-Infinity sections
    (offload_param and offload_optimizer to "nvme", the aio section): the z2/z3 checks, resume included."""
    result = run_under_deepspeed_launcher("hf_trainer_worker.py", tmp_path, ["z3nvme"])
    assert len(result["z3nvme"]["losses"]) == 20
    assert os.listdir(os.path.join(tmp_path, "nvme")) == []


@pytest.mark.slow   # a third launch of the Accelerate worker
def test_accelerate_plugin_zero3_nvme_offload(tmp_path):
    """`DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="nvme", offload_param_device="nvme",
    offload_optimizer_nvme_path=..., offload_param_nvme_path=...)`: the same checks as z2/z3, and
    the swap directories are gone at the end."""
    result = _accelerate_launch(tmp_path, ["z3nvme"])
    assert len(result["z3nvme"]["losses"]) == 20
    assert os.listdir(os.path.join(tmp_path, "nvme")) == []
