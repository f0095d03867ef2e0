"""The CPU half of test_checkpoint_devices.py, run in a process that sees no GPU: load the
checkpoint the GPU process saved (tag "gpu"), check it against the state that process recorded,
consolidate it with zero_to_fp32, train one step on the CPU and save tag "cpu" for the way back."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_helpers import batches, config, engine_for, train, training_state  # noqa: E402


def main(folder: Path) -> None:
    assert not torch.cuda.is_available(), "the CPU side must not see a GPU"
    engine = engine_for(config(2), seed=5)   # another initialization: the load must overwrite it
    assert engine.device.type == "cpu"
    engine.load_checkpoint(str(folder), tag="gpu")
    expected = torch.load(folder / "gpu_state.pt")
    for key, tensors in training_state(engine).items():
        for got, want in zip(tensors, expected[key], strict=True):
            assert torch.equal(got, want), f"{key} differs after loading the GPU checkpoint on the CPU"
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="gpu")
    for (name, _), want in zip(engine.module.named_parameters(), expected["masters"], strict=True):
        assert torch.equal(consolidated[name], want), f"zero_to_fp32 {name} differs"
    train(engine, batches(4, torch.device("cpu"))[2:3])
    torch.save(training_state(engine), folder / "cpu_state.pt")
    engine.save_checkpoint(str(folder), tag="cpu")
    engine.destroy()
    print("cpu side ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
