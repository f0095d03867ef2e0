"""`offload_optimizer.pin_memory` reaches the ZeRO optimizers (stages 1-3) on real gloo ranks
([Note: pinned optimizer offload] in deepspeed/runtime/zero/host_buffers.py).

A CPU-only torch cannot pin, and on the CPU accelerator nothing is pinned (checked). To follow the
path a CUDA machine takes, the job stands in for the two device-only pieces: `pinning` answers as
with a CUDA accelerator (pin when asked and offloaded) and the allocation records its pin flag and
returns an ordinary tensor. The run then allocates every master and gradient copy "pinned", issues
the gradient copies with non_blocking=True and waits once per step, and trains bit for bit as
without pinning. tests/gpu/test_cuda_training.py checks real pinned memory on CUDA."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from test_engine_dp import _config, train_engine


def _shards(engine) -> list:
    opt = engine.optimizer
    return list(getattr(opt, "units", None) or opt.buckets)


def _run(config: dict, steps: int, as_on_cuda: bool) -> dict:
    import deepspeed.runtime.zero.host_buffers as host_buffers
    import deepspeed.runtime.zero.optimizer as zero_optimizer

    requests, allocations, waits, pinned = [], [], [], []
    saved = zero_optimizer.pinning, host_buffers._allocate, zero_optimizer.DeviceToHost

    def pinning(requested, source, target):   # as with the CUDA accelerator, params on its device
        requests.append(bool(requested))
        return bool(requested) and target.type == "cpu"

    def allocate(shape, dtype, pin):
        allocations.append(pin)
        return torch.empty(shape, dtype=dtype)   # what torch cannot pin here

    class Recorded(host_buffers.DeviceToHost):
        def wait(self):
            waits.append(self.asynchronous)
            super().wait()

    def inspect(engine, step):
        if step == -1:
            pinned.extend(s.pinned for s in _shards(engine))

    if as_on_cuda:
        zero_optimizer.pinning, host_buffers._allocate, zero_optimizer.DeviceToHost = pinning, allocate, Recorded
    try:
        result = train_engine(config, steps, edit=inspect)
    finally:
        zero_optimizer.pinning, host_buffers._allocate, zero_optimizer.DeviceToHost = saved
    return {"losses": result["losses"], "state": result["state"], "requests": requests,
            "allocations": allocations, "waits": waits, "pinned": pinned}


def _pin_job(stage: int, steps: int) -> dict:
    def config(pin):
        return _config(micro=2, gas=2, zero_optimization={"stage": stage, "reduce_bucket_size": 200,
                                                          "offload_optimizer": {"device": "cpu", "pin_memory": pin}})
    return {"pinned": _run(config(True), steps, True), "unpinned": _run(config(False), steps, True),
            "cpu": _run(config(True), steps, False)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_pin_memory_reaches_the_buffers(stage: int) -> None:
    steps = 3
    for r in run_distributed(2, _pin_job, stage, steps):
        pinned, unpinned, cpu = r["pinned"], r["unpinned"], r["cpu"]
        shards = len(pinned["pinned"])
        assert shards > 1 and all(pinned["pinned"]), pinned["pinned"]
        assert pinned["requests"] == [True] * shards
        assert pinned["allocations"] == [True] * (2 * shards)      # each master and its gradient copy
        assert pinned["waits"] == [shards] * steps                 # every copy asynchronous, one wait a step
        assert unpinned["requests"] == [False] * shards and not any(unpinned["pinned"])
        assert unpinned["allocations"] == [] and not any(unpinned["waits"])
        assert not any(cpu["pinned"]) and cpu["waits"] == []       # the CPU accelerator: nothing pinned
        for other in (unpinned, cpu):                              # numerics unchanged
            assert pinned["losses"] == other["losses"]
            for name, value in other["state"].items():
                assert torch.equal(pinned["state"][name], value), name
