"""A checkpoint saved on the GPU loads on a machine without one (and consolidates there with
zero_to_fp32), and one saved there loads back onto the GPU: the state moves bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from gpu_helpers import batches, config, engine_for, train, training_state

CPU_SIDE = Path(__file__).with_name("ckpt_cpu_side.py")


def test_checkpoint_saved_on_gpu_loads_on_cpu_and_back(device, tmp_path):
    data = batches(4, device)
    engine = engine_for(config(2))
    train(engine, data[:2])
    engine.save_checkpoint(str(tmp_path), tag="gpu")
    torch.save(training_state(engine), tmp_path / "gpu_state.pt")

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(CPU_SIDE), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "cpu side ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]

    engine.load_checkpoint(str(tmp_path), tag="cpu")
    expected = torch.load(tmp_path / "cpu_state.pt")
    for key, tensors in training_state(engine).items():
        for got, want in zip(tensors, expected[key], strict=True):
            assert torch.equal(got, want), f"{key} differs after loading the CPU checkpoint on the device"
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum, get_state_devices

    for kind in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_params):
        assert {d.type for d in get_state_devices(engine, kind)} == {device.type}, kind
    assert all(torch.isfinite(torch.tensor(train(engine, data[3:]))))
    engine.destroy()
