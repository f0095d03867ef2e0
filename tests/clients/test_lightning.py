"""Lightning 2.6 (Trainer and Fabric) on our `deepspeed`, 2 CPU ranks over gloo.

Each test runs lightning_worker.py in a subprocess; Lightning's own launcher starts the second
rank. One launch trains 20 steps, saves at step 10 and at the end, resumes from step 10 in the
same processes and trains steps 11-20 again. Checked here: the loss falls; the resumed steps
reproduce losses and learning rates; Lightning's `convert_zero_checkpoint_to_fp32_state_dict` and
our `zero_to_fp32` give the trained fp32 weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

WORKER = os.path.join(os.path.dirname(__file__), "lightning_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(mode: str, stage: int, out: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(var, None)  # a fresh launch: Lightning picks a free port and starts rank 1 itself
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, WORKER, mode, str(stage), out], env=env, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def _check(result: dict, out: str, prefix: str = "") -> None:
    full, resumed = result["full"], result["resumed"]
    losses = [row[1] for row in full]
    assert len(full) == 20 and [row[0] for row in full] == list(range(1, 21))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, f"loss did not fall: {losses}"

    # resume from the step-10 checkpoint: steps 11-20 again, same losses and learning rates
    assert [row[0] for row in resumed] == list(range(11, 21))
    for a, b in zip(full[10:], resumed):
        assert b[1] == pytest.approx(a[1], rel=1e-6, abs=1e-7), f"step {a[0]}: loss {b[1]} != {a[1]}"
        assert b[2] == pytest.approx(a[2], rel=1e-12), f"step {a[0]}: lr {b[2]} != {a[2]}"

    weights = torch.load(os.path.join(out, "weights.pt"), weights_only=True)
    trained = weights["full"]
    for name, value in weights["resumed"].items():  # the resumed run ends where the full one did
        torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6)

    # Lightning's converter (keeps Lightning's client state next to the fp32 state dict)
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    converted = convert_zero_checkpoint_to_fp32_state_dict(result["final"], os.path.join(out, "lightning_fp32.pt"))
    state = torch.load(os.path.join(out, "lightning_fp32.pt"), weights_only=False)["state_dict"]
    assert set(converted["state_dict"]) == set(state)
    _same(state, trained, prefix)

    # ours, on the same checkpoint
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _same(get_fp32_state_dict_from_zero_checkpoint(result["final"]), trained, prefix)


def _same(state: dict, trained: dict, prefix: str) -> None:
    assert sorted(state) == sorted(prefix + k for k in trained)
    for name, value in trained.items():
        assert state[prefix + name].dtype == torch.float32
        torch.testing.assert_close(state[prefix + name], value, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_trainer_deepspeed(stage, tmp_path):
    """`Trainer(strategy=DeepSpeedStrategy(stage=...), accelerator="cpu", devices=2)`: fit, save via
    `trainer.save_checkpoint`, resume via `fit(ckpt_path=...)`."""
    out = str(tmp_path)
    result = _launch("trainer", stage, out)
    _check(result, out)
    # the checkpoint directory Lightning expects (its _validate_checkpoint_directory)
    assert os.path.isdir(os.path.join(result["step10"], "checkpoint"))
    assert open(os.path.join(result["step10"], "latest")).read().strip() == "checkpoint"


def test_lightning_fabric_deepspeed_stage3(tmp_path):
    """`Fabric(strategy=DeepSpeedStrategy(stage=3), accelerator="cpu", devices=2)`: the model built
    under `fabric.init_module()` (zero.Init), `fabric.save` / `fabric.load`."""
    out = str(tmp_path)
    _check(_launch("fabric", 3, out), out)


@pytest.mark.slow   # ~55 s on 2 shared cores
def test_lightning_fabric_deepspeed_stage3_nvme(tmp_path):
    """ZeRO-Infinity through Fabric: `DeepSpeedStrategy(offload_optimizer_device="nvme",
    offload_parameters=True, offload_params_device="nvme", remote_device="nvme", nvme_path=...)`;
    the same checks, and the swap directories are gone when the run ends."""
    out = str(tmp_path)
    result = _launch("fabric-nvme", 3, out)
    assert result["swapping"] == [True, True]   # parameter shards and optimizer state in swap files
    _check(result, out)
    assert os.listdir(os.path.join(out, "nvme")) == []
