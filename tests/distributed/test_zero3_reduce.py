"""ZeRO-3 gradient reduction (deepspeed/runtime/zero/stage3/reducer.py and the coordinator's
completion rules), on real gloo processes against a plain-PyTorch replica of every rank's work:

- [Note: leaf units complete by module]: routing inside a leaf that differs by rank (one rank's
  tokens reach every expert, another's only some) used to make the ranks reduce the leaf's unit
  at different points and hang; now its gradients equal the replica's at world 2 and 4;
- [Note: ZeRO-3 reduce-scatter buckets]: small units share one reduce-scatter, units at least
  a bucket large go alone, and the averaged gradient shards equal the unbucketed ones."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import run_distributed

from deepspeed import comm as ds_comm
from deepspeed.runtime.zero.stage3 import Stage3Coordinator, watchdog
from deepspeed.runtime.zero.stage3.reducer import bucket_cap
from deepspeed.utils import set_z3_leaf_modules
from deepspeed.zero import register_external_parameter


class Experts(nn.Module):
    """`route[r]`: the experts rank r's tokens reach (data-dependent routing stand-in)."""

    def __init__(self, count: int = 3) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(count))
        self.route: list[int] = [0]
        self.shared: list[nn.Linear] = []   # another module's layer, read when expert 0 runs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h + sum(torch.tanh(self.experts[i](h)) for i in self.route)
        if self.shared and 0 in self.route:
            out = out + h @ self.shared[0].weight.T
        return out


class Routed(nn.Module):
    """`variant`: "plain"; "direct" (the model's input, a leaf tensor requiring grad, goes straight
    into the first leaf); "checkpointed" (the first leaf under reentrant checkpointing: its input
    is a detached leaf tensor); "shared" (the first leaf reads `shared.weight`, owned by a module
    that runs later, registered as its external parameter)."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(8, 8)
        self.moe = Experts()
        self.mid = nn.Linear(8, 8)
        self.moe2 = Experts()
        self.shared = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 2)
        if variant == "shared":
            self.moe.shared.append(self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "direct":
            h = self.moe(x)
        elif self.variant == "checkpointed":
            h = checkpoint(self.moe, torch.tanh(self.inp(x)), use_reentrant=True)
        else:
            h = self.moe(torch.tanh(self.inp(x)))
        h = self.moe2(torch.tanh(self.mid(h)))
        return self.head(torch.tanh(self.shared(h)))


ROUTES = {  # rank -> (moe route, moe2 route); rank 0 uses every expert, the others some
    0: ([0, 1, 2], [2, 0, 1]), 1: ([1], [0]), 2: ([], [1, 2]), 3: ([2], [])}


def _grads_equal_replica(model: nn.Module, coord: Stage3Coordinator, ref: nn.Module, world: int,
                         steps: int, gas: int = 1) -> None:
    rank = ds_comm.get_rank()
    for step in range(steps):
        for k in range(gas):
            for r in range(world):   # the replica runs every rank's micro-batch with its routes
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * k + r))
                x.requires_grad_(model.variant == "direct")
                ref.moe.route, ref.moe2.route = ROUTES[r]
                (ref(x).square().mean() / (world * gas)).backward()
                if r == rank:
                    model.moe.route, model.moe2.route = ROUTES[r]
                    (model(x).square().mean() / gas).backward()
        grads = coord.full_state(grads=True)
        for name, p in ref.named_parameters():
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(grads[name], expected, rtol=1e-6, atol=1e-7, msg=name)
            p.grad = None
        coord.zero_grad()


def routing_differs_by_rank(gas: int, variant: str = "plain") -> int:
    previous = watchdog.configure(timeout_s=20.0)    # a regression fails in seconds, not minutes
    try:
        rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
        torch.manual_seed(0)
        model = Routed(variant)
        ref = copy.deepcopy(model)
        set_z3_leaf_modules(model, [Experts])
        if variant == "shared":
            register_external_parameter(model.moe, model.shared.weight)
        coord = Stage3Coordinator(model, reduce_bucket_size=0)
        _grads_equal_replica(model, coord, ref, world, steps=2, gas=gas)
        return coord.reducer.collectives
    finally:
        watchdog.configure(**vars(previous))


@pytest.mark.parametrize("world,gas", [(2, 1), (4, 2)])
def test_routing_inside_leaves_that_differs_by_rank(world: int, gas: int) -> None:
    """Every rank reduces every trainable unit once per backward (6 units, 2 of them leaves)."""
    assert run_distributed(world, routing_differs_by_rank, gas) == [6 * 2 * gas] * world


@pytest.mark.parametrize("variant", ["direct", "checkpointed", "shared"])
def test_leaf_input_without_grad_fn_and_units_shared_with_a_leaf(variant: str) -> None:
    """An input without grad_fn gives no completion point (the leaf waits for the end of the
    backward; before, its unit was reduced before a weight's gradient arrived); a unit owned
    elsewhere but read inside a leaf on some ranks only completes by module too."""
    assert run_distributed(2, routing_differs_by_rank, 2, variant) == [6 * 2 * 2] * 2


class Ladder(nn.Module):
    """Units of 20, 72 (x4), 520 (`big`), 72 (x2) and 18 elements: a bucket of 160 groups
    the small ones, `big` goes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(20))
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.big = nn.Linear(8, 64)
        self.down = nn.Linear(64, 8, bias=False)
        self.tail = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale[:8]
        for layer in self.small:
            h = torch.tanh(layer(h))
        h = self.down(torch.relu(self.big(h)))
        for layer in self.tail:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_bucket_cap() -> None:
    """[Note: ZeRO-3 reduce-scatter buckets]: the config's size, at most max(largest unit, 2^20)."""
    assert bucket_cap(5_000_000, 1_050_000) == 1_050_000     # the 19M GPT: its largest unit
    assert bucket_cap(5_000_000, 16_640) == 1 << 20          # the tiny GPT: one bucket for all
    assert bucket_cap(160, 576) == 160 and bucket_cap(0, 576) == 0


def bucketed(bucket: int) -> dict:
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    torch.manual_seed(0)
    model = Ladder()
    coord = Stage3Coordinator(model, reduce_bucket_size=bucket)
    ds_comm.comms_counter.reset()
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
    count = ds_comm.comms_counter.summary().get("reduce_scatter_tensor", {}).get("count", 0)
    return {"grads": coord.full_state(grads=True), "collectives": coord.reducer.collectives, "counted": count,
            "units": len(coord.units)}


@pytest.mark.parametrize("world", [2, 4])
def test_buckets_group_small_units_and_keep_the_gradients(world: int) -> None:
    alone = run_distributed(world, bucketed, 0)
    grouped = run_distributed(world, bucketed, 160)
    assert alone[0]["collectives"] == alone[0]["counted"] == 2 * alone[0]["units"] == 2 * 10
    # completion order and queue (bucket 160): head 18 + tail.1 72 | tail.0 72 (down would not fit) |
    # down 512 alone | big 576 alone | small.3 + small.2 | small.1 + small.0 (scale would not fit) |
    # scale 20 (flushed by the end of the backward): 7 reduce-scatters per backward instead of 10
    assert grouped[0]["collectives"] == grouped[0]["counted"] == 2 * 7, grouped[0]
    # a larger bucket holds the whole model (every unit is far below 2^20 elements): 1 per backward
    whole = run_distributed(world, bucketed, 10**9)
    assert whole[0]["collectives"] == whole[0]["counted"] == 2 * 1, whole[0]
    for a, b in [*zip(alone, grouped), *zip(alone, whole)]:
        for name, g in a["grads"].items():
            torch.testing.assert_close(b["grads"][name], g, rtol=1e-6, atol=1e-7, msg=name)
        assert any(g.abs().sum() > 0 for g in a["grads"].values())
