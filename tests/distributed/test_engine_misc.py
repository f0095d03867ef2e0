"""Engine logging (steps_per_print, wall_clock_breakdown, comms_logger), accessors, single-process init."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys

import torch

from harness import run_distributed
from models import make_model


def logged_training() -> dict:
    import deepspeed
    from deepspeed.utils.logging import logger

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Grab()
    logger.addHandler(handler)
    try:
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "wall_clock_breakdown": True,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "comms_logger": {"enabled": True, "verbose": True, "prof_all": True}}
        engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):   # the breakdown is printed, as upstream's
            for _ in range(4):
                engine.backward(engine(torch.randn(2, 16), torch.tensor([0, 1])))
                engine.step()
        accessors = (engine.zero_optimization_stage(), engine.fp16_enabled(), engine.optimizer_name(),
                     engine.gradient_clipping(), engine.steps_per_print(), engine.get_batch_info())
        deepspeed.comm.configure(enabled=False, verbose=False)
    finally:
        logger.removeHandler(handler)
    return {"records": records, "accessors": accessors, "stdout": stdout.getvalue()}


def test_progress_timers_and_comms_logging() -> None:
    r0, r1 = run_distributed(2, logged_training)
    progress = [m for m in r0["records"] if m.startswith("[Rank 0] step=")]
    assert len(progress) == 2 and "step=4" in progress[1] and "loss=" in progress[1] and "lr=[0.1]" in progress[1]
    assert not [m for m in r1["records"] if "step=" in m]  # progress is printed on rank 0 only
    assert any("time (ms)" in m and "fwd" in m and "bwd" in m for m in r0["stdout"].splitlines())
    assert "time (ms)" not in r1["stdout"]
    assert any("comm op: all_reduce" in m for m in r0["records"])
    assert r0["accessors"] == (0, False, "SGD", 1.0, 2, (4, 2, 1))  # upstream keeps torch names as written


def test_init_distributed_without_any_launcher() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    code = ("import deepspeed, deepspeed.comm as dist; deepspeed.init_distributed(verbose=False); "
            "deepspeed.init_distributed(verbose=False); print(dist.get_rank(), dist.get_world_size(), "
            "dist.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["0", "1", "gloo"]
