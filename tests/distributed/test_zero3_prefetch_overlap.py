"""ZeRO-3 prefetch overlaps the next unit's all-gather with this unit's compute, on real gloo processes.

Every all-gather is made slow: a test-only wrapper around the Work that deepspeed.comm's bounded
all-gather starts (comm/bounded.py `_start_all_gather`, under every unit all-gather: primary, qwZ's
int8 one and hpZ's secondary one) completes it no earlier than DELAY_S after it was issued, as a
slow network would; the data still moves through gloo. Each layer's forward and backward take
COMPUTE_S of wall time (an autograd Function that sleeps each way). With prefetch one unit ahead,
the all-gather of layer k+1 must be issued before layer k computes and still be in flight when
layer k's forward ends (its wait returns after), and forward + backward must take clearly less
wall time than without prefetch (< 0.75x; ideal here ~0.6x). A synchronous prefetch -- issued
and waited for in the hook -- fails both. Losses and reduced gradients are bit-identical either
way, for the primary, qwZ and hpZ paths."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from harness import run_distributed

DELAY_S = 0.08       # every all-gather's latency
COMPUTE_S = 0.08     # every layer's forward, and again its backward
LAYERS, WIDTH, STEPS = 6, 32, 3


class _Compute(torch.autograd.Function):
    """Identity that takes COMPUTE_S of wall time in forward and in backward: a layer's compute."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE_S)
        return grad


class SlowLayer(nn.Linear):
    """Records the wall-clock span of its forward and which layers are being prefetched meanwhile."""

    def __init__(self, log: dict) -> None:
        super().__init__(WIDTH, WIDTH)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.monotonic()
        y = _Compute.apply(torch.tanh(super().forward(x)))
        inflight = [i for i, layer in enumerate(self.log["layers"]) if layer.weight.ds_status.name == "INFLIGHT"]
        self.log["spans"].append((start, time.monotonic(), inflight))
        return y


class _SlowWork:
    """A started all-gather that completes no earlier than DELAY_S after it was issued."""

    def __init__(self, work: Any, entry: dict) -> None:
        self.work, self.entry = work, entry
        self.ready = entry["issued"] + DELAY_S

    def _due(self) -> bool:
        return time.monotonic() >= self.ready

    def wait(self, timeout: Any = None) -> Any:
        time.sleep(max(0.0, self.ready - time.monotonic()))
        result = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.entry.setdefault("done", time.monotonic())
        return result

    def is_completed(self) -> bool:
        return self._due() and self.work.is_completed()

    def parts_completed(self) -> bool:   # what deepspeed.comm's guard polls from its thread
        parts = getattr(self.work, "parts_completed", self.work.is_completed)
        return self._due() and parts()


@contextmanager
def _slow_all_gathers(gathers: list[dict]) -> Iterator[None]:
    from deepspeed.comm import bounded

    real = bounded._start_all_gather

    def slow(output: torch.Tensor, tensor: torch.Tensor, timeout_s: float, group: Any) -> Any:
        entry = {"issued": time.monotonic(), "dtype": str(output.dtype), "group": group}
        gathers.append(entry)
        return _SlowWork(real(output, tensor, timeout_s, group), entry)

    bounded._start_all_gather = slow
    try:
        yield
    finally:
        bounded._start_all_gather = real


def _run(variant: str, bucket: int, hpz_group: Any) -> dict:
    """One warm-up step (records the trace), then STEPS timed forward + backward steps."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import Stage3Coordinator

    torch.manual_seed(0)
    log: dict = {"spans": []}
    model = nn.Sequential(*(SlowLayer(log) for _ in range(LAYERS)))
    log["layers"] = list(model)
    coord = Stage3Coordinator(model, prefetch_bucket_size=bucket, quantized_weights=variant == "qwz",
                              hpz_group=hpz_group)
    gathers: list[dict] = []
    times, losses = [], []
    with _slow_all_gathers(gathers):
        for step in range(1 + STEPS):
            if step == 1:
                log["spans"].clear()
                gathers.clear()
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            start = time.monotonic()
            loss = model(x).square().mean()
            loss.backward()
            times.append(time.monotonic() - start)
            losses.append(loss.item())
    # the forward spans that some all-gather was in flight through (issued before, finished after)
    covered = [any(g["issued"] <= begin and g["done"] >= end for g in gathers) for begin, end, _ in log["spans"]]
    return {"times": times[1:], "losses": losses, "grads": [u.grad_shard.clone() for u in coord.units],
            "covered": covered, "inflight": [s[2] for s in log["spans"]], "stats": dict(vars(coord.stats)),
            "kinds": sorted({(g["dtype"], hpz_group is not None and g["group"] is hpz_group) for g in gathers})}


def overlap(variant: str) -> dict:
    import deepspeed.comm as dist

    hpz_group = dist.new_group(list(range(dist.get_world_size()))) if variant == "hpz" else None
    return {"on": _run(variant, 1, hpz_group), "off": _run(variant, 0, hpz_group)}


@pytest.mark.parametrize("variant", ["primary", "qwz", "hpz"])
def test_prefetched_gather_overlaps_the_previous_units_compute(variant: str) -> None:
    for result in run_distributed(2, overlap, variant):
        on, off = result["on"], result["off"]
        # the path under test issued every measured all-gather (hpZ: the secondary copy's, in its node group)
        dtype = "torch.int8" if variant == "qwz" else "torch.float32"
        assert on["kinds"] == off["kinds"] == [(dtype, variant == "hpz")], (on["kinds"], off["kinds"])
        # prefetch one unit ahead: while layer k computes, layer k+1 is being gathered ...
        per_pass = [[k + 1] for k in range(LAYERS - 1)] + [[]]
        assert on["inflight"] == per_pass * STEPS, on["inflight"]
        # ... by an all-gather issued before layer k's forward began and finished after it ended
        assert on["covered"] == ([True] * (LAYERS - 1) + [False]) * STEPS, on["covered"]
        assert not any(off["covered"]), off["covered"]
        assert on["stats"]["waited"] == on["stats"]["prefetched"] > 0 and off["stats"]["prefetched"] == 0
        # the overlap shows in wall time
        t_on, t_off = min(on["times"]), min(off["times"])   # the least disturbed step of each
        print(f"{variant}: forward + backward {t_on:.3f} s with prefetch, {t_off:.3f} s without "
              f"({t_on / t_off:.2f}x)")
        assert t_on < 0.75 * t_off, (on["times"], off["times"])
        # and numerics do not depend on it
        assert on["losses"] == off["losses"]
        for a, b in zip(on["grads"], off["grads"]):
            assert torch.equal(a, b)
