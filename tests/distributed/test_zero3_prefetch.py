"""ZeRO-3 prefetching from the recorded module trace: bit-identical training with and without it,
the same all-gathers per step, prefetches really waited on, a trace invalidated when the control
flow changes, max_live_parameters respected, and prefetch_bucket_size=0 meaning no prefetch, and a prefetched all-gather without a partner
failing within the watchdog's deadline."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from harness import run_distributed
from models import global_batches, micro_slice
from test_engine_dp import _config
from test_zero3_hang import BOUND_S, TIMEOUT_S

BLOCK = 32 * 32 + 32          # elements of one block's unit
STEPS, GAS = 4, 2


class DeepMLP(nn.Module):
    """Seven units; with `skip_odd` the block `blocks.2` is skipped on odd steps (on every rank)."""

    skip_odd = False

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(5))
        self.head = nn.Linear(32, 4)
        self.calls = 0
        self.in_flight_after_block3: list[int] = []   # parameters still being prefetched, per forward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.calls // GAS
        self.calls += 1
        h = torch.relu(self.inp(x))
        for i, block in enumerate(self.blocks):
            if not (self.skip_odd and i == 2 and step % 2 == 1):
                h = torch.tanh(block(h))
            if i == 3:
                status = [getattr(p, "ds_status", None) for p in self.parameters()]
                self.in_flight_after_block3.append(sum(s is not None and s.name == "INFLIGHT" for s in status))
        return nn.functional.cross_entropy(self.head(h), y)


class SkippingMLP(DeepMLP):
    skip_odd = True


def _zero(bucket: int, max_live: int = 1_000_000_000) -> dict:
    # max_reuse_distance 0: every unit is released after its forward and gathered again for its
    # backward, so both passes prefetch (units kept for the backward need no gather)
    return {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": bucket,
            "stage3_max_live_parameters": max_live, "stage3_max_reuse_distance": 0}


def train(zeros: list[dict], model_cls: type = DeepMLP) -> list[dict]:
    """On every rank: one training run per zero_optimization section, from the same model and data."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world, micro = dist.get_rank(), dist.get_world_size(), 2
    runs = []
    for zero in zeros:
        torch.manual_seed(0)
        config = _config(micro=micro, gas=GAS, zero_optimization=zero)
        engine, *_ = deepspeed.initialize(model=model_cls(), config=copy.deepcopy(config))
        coord = engine._stage3
        coord.stats.peak_live = coord.stats.live
        losses, gathers = [], []
        for x, y in global_batches(STEPS, micro * GAS * world):
            dist.comms_counter.reset()
            for k in range(GAS):
                loss = engine(micro_slice(x, micro, k, rank, world), micro_slice(y, micro, k, rank, world))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            gathers.append(dist.comms_counter.summary().get("all_gather_into_tensor", {}).get("count", 0))
        stats = dict(vars(coord.stats))
        runs.append({"losses": losses, "gathers": gathers, "stats": stats, "state": coord.full_state(),
                     "invalidations": coord.prefetcher.invalidations,
                     "in_flight_after_block3": engine.module.in_flight_after_block3,
                     "in_flight": sum(u.status.name == "INFLIGHT" for u in coord.units)})
        engine.destroy()
    return runs


def _assert_identical(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for name, t in a["state"].items():
        assert torch.equal(t, b["state"][name]), name


@pytest.mark.parametrize("world", [2, 4])
def test_prefetch_is_bit_identical_with_the_same_gathers(world: int) -> None:
    for on, off in run_distributed(world, train, [_zero(50_000_000), _zero(0)]):
        _assert_identical(on, off)
        assert on["gathers"] == off["gathers"]                      # all-gathers per step unchanged
        s_on, s_off = on["stats"], off["stats"]
        assert s_on["sync"] + s_on["waited"] == s_off["sync"]       # every gather either waited on or issued
        assert s_on["waited"] == s_on["prefetched"] > s_on["sync"]  # prefetches happen and are all used
        assert s_on["wasted"] == 0 and on["invalidations"] == 0 and on["in_flight"] == 0
        assert s_off["prefetched"] == s_off["waited"] == 0          # prefetch_bucket_size=0: none


def test_changed_control_flow_invalidates_the_trace() -> None:
    for on, off in run_distributed(2, train, [_zero(50_000_000), _zero(0)], SkippingMLP):
        _assert_identical(on, off)
        s_on = on["stats"]
        # every step switches the flow: the first forward and backward of each step mismatch
        assert on["invalidations"] >= 2 * (STEPS - 1)
        assert s_on["wasted"] > 0 and s_on["waited"] > 0 and on["in_flight"] == 0
        assert s_on["waited"] + s_on["wasted"] == s_on["prefetched"]
        assert off["invalidations"] == 0 and off["stats"]["prefetched"] == 0
        # the mismatch is caught when it happens, not at the end of the pass: in the first forward of
        # a step (flow changed) nothing is left in flight past it; in the second, the trace holds
        seen = on["in_flight_after_block3"]
        assert all(n == 0 for n in seen[GAS::GAS]) and all(n > 0 for n in seen[GAS + 1::GAS]), seen


def test_max_live_parameters_bounds_prefetching() -> None:
    limit = 2 * BLOCK
    limited, unlimited, off = run_distributed(2, train, [_zero(50_000_000, limit), _zero(50_000_000), _zero(0)])[0]
    _assert_identical(limited, off)
    # synchronous gathers may exceed the limit (they are needed); prefetches never push beyond it
    assert limited["stats"]["peak_live"] <= max(limit, off["stats"]["peak_live"])
    assert limited["stats"]["prefetched"] > 0
    assert unlimited["stats"]["peak_live"] > limit          # the limit is what bounded it
    assert limited["stats"]["prefetched"] < unlimited["stats"]["prefetched"] or \
        limited["stats"]["peak_live"] < unlimited["stats"]["peak_live"]


def test_small_bucket_prefetches_one_unit_ahead() -> None:
    """A bucket smaller than a unit still prefetches it (DeepSpeed: the last unit may overshoot),
    one unit ahead: fewer live elements than a bucket that covers the model."""
    small, large = run_distributed(2, train, [_zero(1), _zero(50_000_000)])[0]
    _assert_identical(small, large)
    assert small["stats"]["waited"] == large["stats"]["waited"] > 0
    assert small["stats"]["peak_live"] < large["stats"]["peak_live"]


def prefetch_alone(variant: str = "primary") -> None:
    """Both ranks follow the trace to the first unit; then rank 1 does host work for longer than
    the deadline, so rank 0's prefetched all-gather of the next unit has no partner in time.
    `variant`: the gather path, "primary", "qwz" (int8) or "hpz" (the secondary copy's, after the
    trace-recording forward made it)."""
    from test_zero3_hang import Stack, _configure, _outcome

    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import Stage3Coordinator

    _configure()
    torch.manual_seed(0)
    model = Stack(layers=3)
    hpz_group = dist.new_group([0, 1]) if variant == "hpz" else None
    coord = Stage3Coordinator(model, prefetch_bucket_size=10**6, quantized_weights=variant == "qwz",
                              hpz_group=hpz_group)
    with torch.no_grad():
        model(torch.randn(2, 8))            # records the trace on both ranks
    start = time.monotonic()

    def diverge() -> None:
        with torch.no_grad():
            if dist.get_rank() == 0:
                model(torch.randn(2, 8))     # gathers layers.0, prefetches layers.1-2, waits for layers.1
            else:
                coord.units[0].acquire()     # pairs with rank 0's gather of layers.0, then stalls
                time.sleep(TIMEOUT_S + 1.0)
                model(torch.randn(2, 8))

    _outcome(start, diverge)


@pytest.mark.parametrize("variant", ["primary", "qwz", "hpz"])
def test_unpartnered_prefetch_is_bounded_and_named(variant: str) -> None:
    """The prefetch is asynchronous; the wait for it (the next module's gather) fails at the deadline
    the operation carries, naming the unit and that it was a prefetch, on every gather path."""
    from test_zero3_hang import _assert_names, _outcomes

    outcomes = _outcomes(2, prefetch_alone, variant)
    assert TIMEOUT_S - 0.5 < outcomes[0]["elapsed"] < BOUND_S, outcomes[0]
    assert "collective failed" in outcomes[0]["message"], outcomes[0]["message"]
    phase = "forward prefetch (hpZ)" if variant == "hpz" else "forward prefetch"
    _assert_names(outcomes[0]["message"], f"{phase} all-gather of module 'layers.1'", "layers.1.weight")
    assert outcomes[1]["elapsed"] < BOUND_S, outcomes[1]
