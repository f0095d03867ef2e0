"""No silent hangs at ZeRO-3 (deepspeed/runtime/zero/stage3/watchdog.py, [Note: ZeRO-3 divergence]).

Ranks that run different modules issue different unit collectives. On real gloo processes:
every rank must raise ZeRO3DivergenceError within the bound (DEEPSPEED_ZERO3_TIMEOUT_S, a few
seconds here; the harness's gloo timeout is 90 s, so a hang or a backend error would show) with
the modules and parameters named and the leaf-module remedy, while the normal path keeps one
all-gather per unit. A failing rank raises RuntimeError("OUTCOME {json}") so that the harness
tears the (now broken) process group down; the test reads every rank's outcome from the error."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from torch import nn

from harness import DistributedTestError, run_distributed

from deepspeed import comm as ds_comm
from deepspeed.runtime.zero.stage3 import Stage3Coordinator
from deepspeed.runtime.zero.stage3 import watchdog
from deepspeed.utils import set_z3_leaf_modules

TIMEOUT_S = 3.0
BOUND_S = TIMEOUT_S + 10.0 + 2.0   # deadline + the wait for the other ranks' reports + slack


class Expert(nn.Linear):
    pass


class MoE(nn.Module):
    """Data-dependent routing: `route` lists the experts this rank runs (its tokens went there);
    `wide` experts have twice the elements of the others."""

    def __init__(self, experts: int, wide: tuple[int, ...]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(8, 16 if i in wide else 8) for i in range(experts))
        self.proj = nn.ModuleList(nn.Linear(16, 8) if i in wide else nn.Identity() for i in range(experts))
        self.route: list[int] = [0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return sum(self.proj[i](torch.tanh(self.experts[i](h))) for i in self.route)


class Routed(nn.Module):
    def __init__(self, experts: int = 2, wide: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = MoE(experts, wide)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.tanh(self.inp(x))))


class Stack(nn.Module):
    """Identical layers (every unit the same size); `extra` runs only when asked."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.extra = nn.Linear(8, 8)
        self.use_extra_after: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == self.use_extra_after:
                x = torch.tanh(self.extra(x))
        return x


def _configure(strict: bool = False, every: int = 4) -> watchdog.Settings:
    """The test settings (the workers outlive a test: passing tests put the previous ones back)."""
    return watchdog.configure(timeout_s=TIMEOUT_S, check_every=every, strict=strict)


def _outcome(start: float, fn) -> None:
    """Run `fn`; a ZeRO3DivergenceError becomes RuntimeError('OUTCOME {...}') with its timing."""
    try:
        fn()
    except watchdog.ZeRO3DivergenceError as exc:
        raise RuntimeError("OUTCOME " + json.dumps({"rank": ds_comm.get_rank(), "elapsed": time.monotonic() - start,
                                                     "message": str(exc)})) from None
    # no error on this rank: the harness returns normally for it, and the test sees it missing


def _outcomes(world: int, fn, *args) -> dict[int, dict]:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(world, fn, *args)
    text = str(info.value)
    found = {}
    for line in re.findall(r"RuntimeError: OUTCOME (\{.*\})", text):
        record = json.loads(line)
        found[record["rank"]] = record
    assert sorted(found) == list(range(world)), text
    return found


def _assert_names(message: str, *names: str) -> None:
    for name in names:
        assert name in message, f"{name!r} not in:\n{message}"
    assert "set_z3_leaf_modules" in message and "leaf_module" in message, message


# --- the normal path ---------------------------------------------------------------------------
def normal_path(strict: bool, steps: int) -> dict:
    previous = _configure(strict=strict, every=1)      # compare after every collective: no false alarm
    try:
        torch.manual_seed(0)
        model = Routed(experts=2, wide=(1,))
        model.moe.route = [0, 1]
        coord = Stage3Coordinator(model)
        watch = watchdog._watch(None)
        checked_before = watch.last_check
        gathers, reduces = [], []
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + ds_comm.get_rank()))
            ds_comm.comms_counter.reset()
            out = model(x)
            gathers.append(ds_comm.comms_counter.summary()["all_gather_into_tensor"]["count"])
            ds_comm.comms_counter.reset()
            out.square().sum().backward()
            reduces.append(ds_comm.comms_counter.summary()["reduce_scatter_tensor"]["count"])
        checked = watch.last_check > checked_before
        coord.remove()
        # every unit (inp, moe.experts.0/1, moe.proj.1, head) is used in forward, none is persistent
        return {"gathers": gathers, "reduces": reduces, "units": len(coord.units), "checked": checked}
    finally:
        watchdog.configure(**vars(previous))


@pytest.mark.parametrize("world", [2, 4])
def test_normal_path_one_collective_per_unit(world: int) -> None:
    for r in run_distributed(world, normal_path, False, 3):
        assert r["checked"], "the schedule check never ran"
        assert r["units"] == 5 and r["gathers"] == [5] * 3       # one all-gather per unit in forward
        assert r["reduces"] == [r["units"]] * 3                  # one reduce-scatter per trainable unit


def test_strict_mode_adds_one_fingerprint_per_collective() -> None:
    for r in run_distributed(2, normal_path, True, 2):
        assert r["gathers"] == [2 * r["units"]] * 2              # fingerprint + data, per unit
        assert r["reduces"] == [r["units"]] * 2                  # the reduce-scatter's fingerprint is an all-gather


# --- (b) different modules at the same position ---------------------------------------------------
def different_experts(strict: bool, leaf: bool, odd_one_out: bool = False) -> None:
    """Rank r runs expert r % 2 only (or: the last rank runs expert 1, the others expert 0):
    same-size experts pair up silently unless detected."""
    previous = _configure(strict=strict)
    torch.manual_seed(0)
    model = Routed(experts=2)
    if leaf:
        set_z3_leaf_modules(model, [MoE])     # the experts gathered together: the same collectives everywhere
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    model.moe.route = [int(rank == world - 1)] if odd_one_out else [rank % 2]
    Stage3Coordinator(model)
    start = time.monotonic()

    def train() -> None:
        for step in range(6):
            model(torch.randn(4, 8)).square().sum().backward()

    _outcome(start, train)
    watchdog.configure(**vars(previous))    # reached only when no rank diverged (the leaf-module case)


@pytest.mark.parametrize("world,odd_one_out", [(2, False), (4, False), (4, True)])
def test_different_same_size_experts_fail_on_every_rank(world: int, odd_one_out: bool) -> None:
    """Ranks whose neighbour differs find it at a schedule check, raise and break the group. At
    world 2 the other rank's next collective then fails at once; at world 4 a rank blocked on
    ranks that are blocked too fails only at its deadline (then the rest at once)."""
    outcomes = _outcomes(world, different_experts, False, False, odd_one_out)
    for rank, o in outcomes.items():
        assert o["elapsed"] < (TIMEOUT_S if world == 2 else BOUND_S), o
        _assert_names(o["message"], "moe.experts.0", "moe.experts.0.weight", "moe.experts.1", "moe.experts.1.bias")
        assert re.search(r"First difference at unit collective #\d+: on this rank the forward all-gather of module "
                         r"'moe\.experts\.\d' .*; on rank \d the forward all-gather of module 'moe\.experts\.\d'",
                         o["message"]), o["message"]


def test_routing_inside_a_leaf_module_runs() -> None:
    """The remedy the error suggests: the same routing inside a leaf module raises nothing."""
    run_distributed(2, different_experts, False, True)


def different_experts_wide() -> None:
    """Rank 0 runs a wide expert where rank 1 runs a narrow one: without the strict check gloo
    would abort the receiving process; with it every rank raises before the data collective."""
    _configure(strict=True)
    torch.manual_seed(0)
    model = Routed(experts=2, wide=(0,))
    model.moe.route = [ds_comm.get_rank() % 2]
    Stage3Coordinator(model)
    start = time.monotonic()
    _outcome(start, lambda: model(torch.randn(4, 8)).sum().backward())


def test_strict_different_size_experts_fail_before_the_collective() -> None:
    outcomes = _outcomes(2, different_experts_wide)
    for o in outcomes.values():
        assert o["elapsed"] < TIMEOUT_S, o        # detected by the fingerprint, no deadline involved
        _assert_names(o["message"], "moe.experts.0", "moe.experts.0.weight", "moe.experts.1", "moe.experts.1.weight")
        assert "about to issue a different collective" in o["message"], o["message"]


# --- (a) one rank runs an extra module --------------------------------------------------------------
def extra_module(strict: bool) -> None:
    """Rank 0 runs `extra` once; every unit has the same size, so the streams shift silently."""
    _configure(strict=strict)
    torch.manual_seed(0)
    model = Stack()
    Stage3Coordinator(model)
    start = time.monotonic()

    def evaluate() -> None:
        with torch.no_grad():
            for batch in range(8):
                model.use_extra_after = 1 if (batch == 0 and ds_comm.get_rank() == 0) else None
                model(torch.randn(2, 8))

    _outcome(start, evaluate)


@pytest.mark.parametrize("strict", [False, True])
def test_extra_module_on_one_rank_fails_on_every_rank(strict: bool) -> None:
    outcomes = _outcomes(2, extra_module, strict)
    for o in outcomes.values():
        assert o["elapsed"] < (TIMEOUT_S if strict else BOUND_S), o
        _assert_names(o["message"], "'extra'", "extra.weight", "extra.bias", "'layers.2'", "layers.2.weight")


def extra_gather_alone() -> None:
    """Rank 0's last module runs only there: its all-gather has no partner while rank 1 does host
    work for longer than the deadline; rank 1 then fails at its next collective."""
    _configure()
    torch.manual_seed(0)
    model = Stack(layers=2)
    Stage3Coordinator(model)
    rank = ds_comm.get_rank()
    start = time.monotonic()

    def evaluate() -> None:
        with torch.no_grad():
            model.use_extra_after = 1 if rank == 0 else None
            model(torch.randn(2, 8))
            if rank != 0:
                time.sleep(TIMEOUT_S + 1.0)
            model.use_extra_after = None
            model(torch.randn(2, 8))

    _outcome(start, evaluate)


def test_unpaired_gather_times_out_and_names_the_module() -> None:
    outcomes = _outcomes(2, extra_gather_alone)
    assert TIMEOUT_S - 0.5 < outcomes[0]["elapsed"] < BOUND_S, outcomes[0]
    assert "collective failed" in outcomes[0]["message"], outcomes[0]["message"]
    for o in outcomes.values():
        assert o["elapsed"] < BOUND_S, o
        _assert_names(o["message"], "forward all-gather of module 'extra'", "extra.weight")


def test_settings_come_from_the_environment() -> None:
    import subprocess
    import sys

    env = dict(os.environ, **{watchdog.TIMEOUT_ENV: "7.5", watchdog.CHECK_ENV: "0", watchdog.STRICT_ENV: "1"})
    code = "from deepspeed.runtime.zero.stage3 import watchdog as w; print(w.SETTINGS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "Settings(timeout_s=7.5, check_every=0, strict=True)" in out, out
