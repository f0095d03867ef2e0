"""ZeRO-3 core (deepspeed/runtime/zero/stage3): gather units, per-module gather/release, gradients
reduce-scattered into shards. Pure unit planning is tested in-process; the rest on real gloo
processes at world 1, 2 and 4 against a plain-PyTorch replica trained on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from harness import run_distributed
from models import TinyMLP, global_batches, micro_slice

from deepspeed import comm as ds_comm
from deepspeed.runtime.zero.stage3 import Stage3Coordinator, ZeroParamStatus, plan_units
from deepspeed.utils.z3_leaf_module import set_z3_leaf_module


class Pair(nn.Module):
    """Flagged as a z3 leaf: gathered as one unit with both children, which get no hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.a(h) + torch.tanh(self.b(h))


class Zoo(nn.Module):
    """A root parameter, a module called twice, a weight tied across modules, a leaf module."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 8)
        self.block = nn.Linear(8, 8)          # called twice per forward
        self.norm = nn.LayerNorm(8)           # 16 elements: persistent at threshold 16
        self.tied = nn.Linear(8, 8)
        self.tied.weight = self.block.weight  # owned by block's unit; tied's unit is its bias
        self.moe = Pair()
        set_z3_leaf_module(self.moe, True)
        self.head = nn.Linear(8, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.tied(self.norm(h)))
        out = self.head(self.moe(h)) * self.temperature
        return out if y is None else F.cross_entropy(out, y)


MODELS = {"tiny": TinyMLP, "zoo": Zoo}
# All-gathers of one forward with nothing gathered beforehand, counted by hand from the model code:
# zoo at threshold 0: root, inp, block x2, norm, tied (block's unit + its bias), moe, head;
# at threshold 16 root (1), norm (16) and tied's bias (8) are persistent.
FORWARD_GATHERS = {("tiny", 0): 3, ("zoo", 0): 9, ("zoo", 16): 6}
TRAINABLE_UNITS = {"tiny": 3, "zoo": 7}


# --- pure planning -------------------------------------------------------------------------------
def test_plan_units_tiny_mlp() -> None:
    plan = plan_units(TinyMLP())
    assert [u.owner for u in plan.units] == ["fc1", "fc2", "head"]
    assert plan.units[0].param_names == ("fc1.weight", "fc1.bias") and plan.units[0].numel == 16 * 32 + 32
    assert plan.module_units == {"fc1": (0,), "fc2": (1,), "head": (2,)}
    assert not any(u.persistent for u in plan.units)


def test_plan_units_tied_leaf_and_persistence() -> None:
    plan = plan_units(Zoo(), persistence_threshold=16)
    owners = [u.owner for u in plan.units]
    assert owners == ["", "inp", "block", "norm", "tied", "moe", "head"]
    by_owner = {u.owner: u for u in plan.units}
    assert by_owner["tied"].param_names == ("tied.bias",)              # the tied weight belongs to block
    assert plan.param_unit["block.weight"] == owners.index("block")
    assert plan.module_units["tied"] == (owners.index("block"), owners.index("tied"))
    assert by_owner["moe"].param_names == ("moe.a.weight", "moe.a.bias", "moe.b.weight", "moe.b.bias")
    assert "moe.a" not in plan.module_units and "moe.b" not in plan.module_units   # leaf: no hooks inside
    assert [u.owner for u in plan.units if u.persistent] == ["", "norm", "tied"]
    assert plan.gathers_per_call("tied") == 1
    capped = plan_units(Zoo(), persistence_threshold=16, model_persistence_threshold=17)
    assert [u.owner for u in capped.units if u.persistent] == ["", "norm"]     # 1 + 16, then the cap


def test_coordinator_without_process_group() -> None:
    """A single process with no process group: gathers are local copies, results equal torch's."""
    torch.manual_seed(0)
    model = Zoo()
    ref = copy.deepcopy(model)
    coord = Stage3Coordinator(model)
    x, y = torch.randn(6, 16), torch.randint(0, 4, (6,))
    loss = model(x, y)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    grads = coord.full_state(grads=True)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert coord.gathered_units() == []
    coord.remove()
    torch.testing.assert_close(model(x, y), ref_loss.detach())


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_without_process_group(reentrant: bool) -> None:
    """The recomputed forward runs inside backward: its gathers nest with the backward hold."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    coord = Stage3Coordinator(model)
    x = torch.randn(4, 8)
    model(x).backward()
    ref(x).backward()
    grads = coord.full_state(grads=True)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert coord.gathered_units() == []


# --- distributed ---------------------------------------------------------------------------------
def _live_param_nbytes(model: nn.Module) -> int:
    """Bytes of every distinct storage reachable from the parameters (`.data` and `ds_tensor`)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        for t in (p.data, p.ds_tensor):
            storage = t.untyped_storage()
            if storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _expected_nbytes(coord: Stage3Coordinator, world: int) -> int:
    """ceil(numel / N) elements per parameter (upstream's ds_tensor), plus the full padded buffer
    of persistent units."""
    total = 0
    for u in coord.plan.units:
        shard = sum(-(-n // world) for n in u.numels)
        total += shard + (shard * world if u.persistent else 0)
    return total * 4


def _check_sharded(model: nn.Module, coord: Stage3Coordinator, world: int) -> None:
    for u in coord.units:
        assert u.available == u.spec.persistent, u
        assert u.forward_refs == 0, u
    for p in model.parameters():
        assert p.grad is None
        assert p.ds_status == (ZeroParamStatus.AVAILABLE if p.ds_persist else ZeroParamStatus.NOT_AVAILABLE)
        assert p.ds_persist or (p.numel() == 0 and p.untyped_storage().nbytes() == 0), p.ds_shape
    assert _live_param_nbytes(model) == _expected_nbytes(coord, world)


def _gathers() -> int:
    return int(ds_comm.comms_counter.summary().get("all_gather_into_tensor", {}).get("count", 0))


def _reduce_scatters() -> int:
    return int(ds_comm.comms_counter.summary().get("reduce_scatter_tensor", {}).get("count", 0))


def zero3_training(name: str, threshold: int, steps: int, gas: int, lr: float = 0.1) -> list[float]:
    """ZeRO-3 on this rank's micro-batches vs. a replica on the global batch, checked every step."""
    rank, world, micro = ds_comm.get_rank(), ds_comm.get_world_size(), 2
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    coord = Stage3Coordinator(model, persistence_threshold=threshold)
    _check_sharded(model, coord, world)
    losses = []
    for x, y in global_batches(steps, micro * gas * world):
        for k in range(gas):
            xs, ys = micro_slice(x, micro, k, rank, world), micro_slice(y, micro, k, rank, world)
            ds_comm.comms_counter.reset()
            loss = model(xs, ys)
            assert _gathers() == FORWARD_GATHERS[(name, threshold)], ds_comm.comms_counter.summary()
            assert [u for u in coord.gathered_units() if not u.spec.persistent] == []
            (loss / gas).backward()
            assert _reduce_scatters() == TRAINABLE_UNITS[name], ds_comm.comms_counter.summary()
            _check_sharded(model, coord, world)
            for r in range(world):   # the replica sees every rank's micro-batch
                ref_loss = ref(micro_slice(x, micro, k, r, world), micro_slice(y, micro, k, r, world))
                (ref_loss / (gas * world)).backward()
                if r == rank:
                    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
            losses.append(loss.item())
        grads = coord.full_state(grads=True)
        for pname, p in ref.named_parameters():
            torch.testing.assert_close(grads[pname], p.grad, rtol=1e-6, atol=1e-6, msg=pname)
        # a trivial SGD step on the shards, and the same on the replica
        for u in coord.units:
            u.shard.add_(u.grad_shard.to(u.shard.dtype), alpha=-lr)
        coord.after_shard_update()
        coord.zero_grad()
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(lr * p.grad)
                p.grad = None
        _check_sharded(model, coord, world)
    full = coord.full_state()
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(full[pname], p.detach(), rtol=1e-5, atol=1e-6, msg=pname)
    return losses


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name,threshold,gas", [("tiny", 0, 1), ("zoo", 0, 2), ("zoo", 16, 1)])
def test_zero3_training_matches_pytorch(world: int, name: str, threshold: int, gas: int) -> None:
    """(a) only shards live between steps, (b) losses, (c) averaged gradient shards and (SGD) the
    parameters after 3 steps equal plain PyTorch's, (d) one all-gather per unit use."""
    results = run_distributed(world, zero3_training, name, threshold, 3, gas)
    assert all(len(r) == 3 * gas for r in results)


def zero3_inference(name: str, threshold: int) -> None:
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    coord = Stage3Coordinator(model, persistence_threshold=threshold)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(rank))
    for grad_enabled in (False, True):     # torch.no_grad(), and a forward whose graph is dropped
        ds_comm.comms_counter.reset()
        with torch.set_grad_enabled(grad_enabled):
            out = model(x)
        assert _gathers() == FORWARD_GATHERS[(name, threshold)]
        assert out.requires_grad == grad_enabled
        torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
        del out
        _check_sharded(model, coord, world)
    with coord.gathered():
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=pname)
    _check_sharded(model, coord, world)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name,threshold", [("tiny", 0), ("zoo", 0), ("zoo", 16)])
def test_zero3_inference_leaves_nothing_gathered(world: int, name: str, threshold: int) -> None:
    """(e) eval forwards gather per module, release everything, and equal the replica."""
    run_distributed(world, zero3_inference, name, threshold)


def zero3_frozen(world_check: int) -> int:
    """A frozen unit is gathered for forward and backward but never reduced, and ends released."""
    torch.manual_seed(0)
    model = Zoo()
    for p in model.inp.parameters():
        p.requires_grad_(False)
    coord = Stage3Coordinator(model)
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    ds_comm.comms_counter.reset()
    model(x, y).backward()
    assert ds_comm.get_world_size() == world_check
    _check_sharded(model, coord, world_check)
    return _reduce_scatters()


@pytest.mark.parametrize("world", [2])
def test_zero3_frozen_unit(world: int) -> None:
    assert run_distributed(world, zero3_frozen, world) == [TRAINABLE_UNITS["zoo"] - 1] * world
