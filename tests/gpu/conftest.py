"""tests/gpu: focused checks that need a CUDA device (tools/gpu/check.sh runs them, docs/gpu.md).

Every test here carries the `gpu` marker and takes the `device` fixture, which skips without
CUDA. `DS_GPU_TESTS_ON_CPU=1` runs them on the CPU instead, to check their logic on a machine
without a GPU (the device-only assertions, pinned memory and allocated bytes, are then skipped);
`make test` does not set it, and without it nothing here runs on a CPU-only machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("DS_GPU_TESTS_ON_CPU") == "1":
        return torch.device("cpu")
    pytest.skip("needs a CUDA device (DS_GPU_TESTS_ON_CPU=1 checks the logic on the CPU)")
