"""deepspeed.zero.Init: parameters partitioned during construction (bytes counted per rank),
options, and deepspeed.initialize adopting the slices without materialising the model, with
training identical to a model built without Init; ZeRO-3 parameter offload (offload_param)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.runtime.engine_setup import NotSupportedYet
from deepspeed.runtime.zero.stage3 import ZeroParamStatus
from harness import run_distributed
from models import TinyMLP, reference_training
from test_engine_dp import _config, train_engine
from test_zero3_engine import CastingMLP, _assert_close_to, _z3


def live_param_bytes(module: nn.Module) -> int:
    """Bytes of distinct storages a rank holds for `module`'s parameters (`.data` and shards)."""
    storages = {}
    for p in module.parameters():
        for t in (p.data, getattr(p, "ds_tensor", None)):
            if t is not None and t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class Stack(nn.Module):
    """Records the parameter bytes alive after each layer is built: the construction peak."""

    def __init__(self, layers: int = 8, dim: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.live: list[int] = []
        for _ in range(layers):
            self.layers.append(nn.Linear(dim, dim))
            self.live.append(live_param_bytes(self))


def build_stack(use_init: bool) -> dict:
    import deepspeed.comm as dist

    torch.manual_seed(100 + dist.get_rank())   # ranks draw different values: Init broadcasts rank 0's
    with deepspeed.zero.Init(enabled=use_init):
        model = Stack()
    shards = {n: p.ds_tensor.clone() for n, p in model.named_parameters()} if use_init else {}
    return {"live": model.live, "final": live_param_bytes(model), "shards": shards,
            "placeholders": all(p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
                                for p in model.parameters()) if use_init else False,
            "ds_numel": {n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters()}}


def test_init_keeps_one_nth_of_the_parameters_per_rank() -> None:
    world = 4
    full = run_distributed(world, build_stack, False)[0]
    results = run_distributed(world, build_stack, True)
    torch.manual_seed(100)
    ref = Stack()   # rank 0's draws
    total = sum(p.numel() for p in ref.parameters()) * 4
    layer = total // len(ref.layers)
    assert full["final"] == total and full["live"][-1] == total     # without Init: everything, all the time
    expected = sum(-(-p.numel() // world) for p in ref.parameters()) * 4
    for r in results:
        assert r["placeholders"] and r["ds_numel"] == {n: p.numel() for n, p in ref.named_parameters()}
        assert r["final"] == expected and expected < total / world + 64   # 1/N (+ padding)
        assert max(r["live"]) <= expected                                 # never more while building
        assert max(r["live"]) < total / world + layer
    for name, p in ref.named_parameters():   # the slices are rank 0's values, split in rank order
        pieces = torch.cat([r["shards"][name] for r in results])
        torch.testing.assert_close(pieces[:p.numel()], p.detach().reshape(-1), rtol=0, atol=0, msg=name)


# --- options (one process, no process group: world 1) ---------------------------------------------
class Rescaled(nn.Linear):
    """Writes its weight after nn.Linear.__init__: partitioning must wait for the outermost __init__."""

    def __init__(self) -> None:
        super().__init__(4, 3)
        with torch.no_grad():
            self.weight.fill_(2.0)


def _full(p: nn.Parameter) -> torch.Tensor:
    with deepspeed.zero.GatheredParameters(p):
        return p.detach().clone()


def test_init_context_options() -> None:
    with deepspeed.zero.Init():
        model = Rescaled()

        class DefinedInside(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(5))

        inside = DefinedInside()
        with deepspeed.zero.Init(dtype=torch.bfloat16):   # nested: a no-op, the outer one partitions
            nested = nn.Linear(2, 2)
    assert model.weight.numel() == 0 and model.weight.ds_shape == (3, 4)
    torch.testing.assert_close(_full(model.weight), torch.full((3, 4), 2.0))
    assert inside.w.numel() == 0 and nested.weight.dtype == torch.float32 and nested.weight.numel() == 0
    assert nn.Linear(2, 2).weight.numel() == 4 and DefinedInside().w.numel() == 5   # unpatched after exit
    with deepspeed.zero.Init(enabled=False):
        assert nn.Linear(2, 2).weight.numel() == 4
    with deepspeed.zero.Init(dtype=torch.bfloat16, remote_device="cpu"):
        half = nn.Embedding(10, 4)
    assert half.weight.dtype == torch.bfloat16 and half.weight.ds_tensor.dtype == torch.bfloat16
    assert half.weight.ds_tensor.device.type == "cpu"
    with deepspeed.zero.Init(config_dict_or_path={"bf16": {"enabled": True}, "train_batch_size": 1}):
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16


def test_init_module_form_and_rejected_options() -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    ref = copy.deepcopy(model)
    deepspeed.zero.Init(module=model)
    assert all(p.numel() == 0 for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q.detach(), rtol=0, atol=0, msg=name)
    for kwargs in ({"remote_device": "disk"}, {"zero_quantized_nontrainable_weights": True}, {"param_swapper": object()}):
        with pytest.raises(NotSupportedYet, match="zero.Init"):
            deepspeed.zero.Init(**kwargs)
    with pytest.raises(ValueError, match=r"remote_device=\"nvme\"\) needs config_dict_or_path with zero_optimization"):
        deepspeed.zero.Init(remote_device="nvme")   # where to swap comes from the config's offload_param


# --- deepspeed.initialize on a model built under Init ----------------------------------------------
def tiny_under_init() -> nn.Module:
    with deepspeed.zero.Init():
        return TinyMLP()


def tiny_under_init_cpu() -> nn.Module:
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True):
        return TinyMLP()


def casting_under_init_bf16() -> nn.Module:
    with deepspeed.zero.Init(dtype=torch.bfloat16):
        return CastingMLP()


@pytest.mark.parametrize("world, threshold", [(1, 0), (2, 0), (4, 600)])
def test_initialize_from_init_equals_plain_pytorch(world: int, threshold: int) -> None:
    """At 600 the fc1 and head units are persistent: adopted and never released."""
    config = _config(micro=1, gas=2, zero_optimization=_z3(threshold))
    results = run_distributed(world, train_engine, config, 6, "engine", tiny_under_init)
    ref_losses, ref_state, _ = reference_training(config, 6, world)
    _assert_close_to(results, ref_losses, ref_state)


def test_initialize_from_init_below_stage_3() -> None:
    """Stages 0-2 make zero.Init parameters whole again and train as usual."""
    config = _config(micro=1, gas=2, zero_optimization={"stage": 1})
    results = run_distributed(2, train_engine, config, 4, "engine", tiny_under_init)
    ref_losses, ref_state, _ = reference_training(config, 4, 2)
    _assert_close_to(results, ref_losses, ref_state)


def train_bf16_from(model_fn) -> dict:
    config = _config(micro=2, gas=1, bf16={"enabled": True}, zero_optimization=_z3())
    return train_engine(copy.deepcopy(config), 3, model_cls=model_fn)


def test_initialize_from_init_bf16_equals_without_init() -> None:
    ref = run_distributed(2, train_bf16_from, CastingMLP)
    results = run_distributed(2, train_bf16_from, casting_under_init_bf16)
    assert results[0]["state"]["fc1.weight"].dtype == torch.bfloat16
    _assert_close_to(results, ref[0]["losses"], ref[0]["state"], rtol=0, atol=0)


def adopt_without_materialising() -> dict:
    """Spy on unit construction: the parameters alive (full) when each unit starts being built."""
    from deepspeed.runtime.zero.stage3 import sharded_param

    torch.manual_seed(0)
    model = tiny_under_init()
    original, seen = sharded_param.ShardedUnit.__init__, []

    def spy(self, spec, params, *args, **kwargs):
        seen.append(sum(p.numel() for p in model.parameters()))
        original(self, spec, params, *args, **kwargs)

    sharded_param.ShardedUnit.__init__ = spy
    try:
        engine, *_ = deepspeed.initialize(model=model, config=_config(zero_optimization=_z3()))
    finally:
        sharded_param.ShardedUnit.__init__ = original
    units = engine._stage3.units
    return {"seen": seen, "bytes": live_param_bytes(model), "shard_bytes": sum(u.shard.numel() * 4 for u in units),
            "ds_numel": [p.ds_numel for p in model.parameters()]}


def test_initialize_adopts_slices_without_materialising() -> None:
    results = run_distributed(2, adopt_without_materialising)
    numels = [p.numel() for p in TinyMLP().parameters()]
    for r in results:
        assert r["seen"] == [0, 0, 0]            # one unit full at a time, never the model
        assert r["bytes"] == r["shard_bytes"] and r["shard_bytes"] < sum(numels) * 4 / 2 + 16
        assert r["ds_numel"] == numels


# --- offload_param -------------------------------------------------------------------------------
def offload_devices(config: dict) -> dict:
    engine, *_ = deepspeed.initialize(model=TinyMLP(), config=copy.deepcopy(config))
    coord = engine._stage3
    return {"shard_device": coord.shard_device, "units": {(u.shard.device.type, u.grad_shard.device.type)
                                                          for u in coord.units}}


@pytest.mark.parametrize("model_fn", [TinyMLP, tiny_under_init_cpu], ids=["plain", "init-remote-cpu"])
def test_offload_param_and_optimizer_equal_stage_0(model_fn) -> None:
    offload = _z3(offload_param={"device": "cpu", "pin_memory": True}, offload_optimizer={"device": "cpu"})
    ref = run_distributed(2, train_engine, _config(micro=1, gas=2, zero_optimization={"stage": 0}), 4)[0]
    results = run_distributed(2, train_engine, _config(micro=1, gas=2, zero_optimization=offload), 4, "engine",
                              model_fn)
    _assert_close_to(results, ref["losses"], ref["state"], atol=1e-7)
    found = run_distributed(1, offload_devices, _config(zero_optimization=offload))[0]
    assert found == {"shard_device": torch.device("cpu"), "units": {("cpu", "cpu")}}
    assert run_distributed(1, offload_devices, _config(zero_optimization=_z3()))[0]["shard_device"] is None


# --- a model larger than a rank's memory cap (RLIMIT_DATA) -----------------------------------------
class Tower(nn.Module):
    """`layers` equal Linear units: any one of them is small next to the whole."""

    def __init__(self, layers: int = 64, dim: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _data_bytes() -> int:
    """What RLIMIT_DATA is checked against: private writable mappings (VmData, Linux >= 4.7)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


_M_MMAP_THRESHOLD = -3


def train_under_data_cap(layers: int, dim: int, cap_fraction: float) -> dict:
    """Caps this rank's data segment below baseline + the model's full fp32 size, checks the cap
    bites (a full-size tensor, a plain construction), then builds and trains under zero.Init."""
    import ctypes
    import gc
    import resource

    import deepspeed.comm as dist

    # glibc serves blocks up to a dynamic threshold (up to 32 MiB) from heaps that keep freed
    # space mapped, and VmData counts it: pin the threshold so freed tensors are unmapped.
    libc = ctypes.CDLL(None)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    warm, *_ = deepspeed.initialize(model=Tower(2, 8), config=config)   # one-time costs (imports) first
    warm.backward(warm(torch.ones(2, 8)))
    warm.step()
    del warm
    full_bytes = layers * (dim * dim + dim) * 4
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    out: dict = {"full_bytes": full_bytes}
    if not hasattr(libc, "mallopt") or not libc.mallopt(_M_MMAP_THRESHOLD, 256 * 1024):
        out["skip"] = "no glibc mallopt(M_MMAP_THRESHOLD)"
    gc.collect()
    out["baseline"] = baseline = _data_bytes()
    out["cap"] = cap = baseline + int(cap_fraction * full_bytes)
    if hard != resource.RLIM_INFINITY and hard < cap:
        out["skip"] = f"hard RLIMIT_DATA {hard} is below the cap {cap}"
    try:
        if "skip" not in out:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))   # soft only: restorable unprivileged
            try:
                torch.empty(full_bytes // 4, dtype=torch.float32).fill_(1.0)
                out["skip"] = "RLIMIT_DATA does not bite here: a tensor larger than the cap was allocated"
            except (MemoryError, RuntimeError):
                pass
        go = torch.tensor([int("skip" not in out)])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)   # every rank goes on, or none (collectives follow)
        if not go.item():
            return out
        try:   # the same model built plainly does not fit either
            Tower(layers, dim)
            out["plain_fits"] = True
        except (MemoryError, RuntimeError):
            out["plain_fits"] = False
        gc.collect()
        out["after_plain"] = _data_bytes() - baseline
        torch.manual_seed(0)
        with deepspeed.zero.Init():
            model = Tower(layers, dim)
        out["after_init"] = _data_bytes() - baseline
        engine, *_ = deepspeed.initialize(model=model, config=config)
        out["after_initialize"] = _data_bytes() - baseline
        losses = []
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        for _ in range(2):
            loss = engine(torch.randn(2, dim, generator=g))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"] = losses
        out["after_train"] = _data_bytes() - baseline
        del engine, model
        gc.collect()
        return out
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)   # glibc's initial threshold (the pool is reused)


def test_init_trains_a_model_larger_than_the_memory_cap() -> None:
    """Each rank caps its data segment (RLIMIT_DATA) at baseline + 0.95 x the model's full fp32
    size: a tensor that size, or the model built plainly, fails; built under zero.Init it trains.
    World 4, not 2: a rank's steady ZeRO-3 state is shard + fp32 master + fp32 gradient shard,
    3/N of the model (SGD without momentum keeps no state), which is 1.5x it at N=2."""
    layers, dim, world = 64, 768, 4   # 64 units of 2.25 MiB: 144 MiB fp32, about 1/64 gathered at a time
    results = run_distributed(world, train_under_data_cap, layers, dim, 0.95)
    skips = {r["skip"] for r in results if "skip" in r}
    if skips:
        pytest.skip("; ".join(sorted(skips)))
    for r in results:
        assert r["cap"] < r["baseline"] + r["full_bytes"]
        assert not r["plain_fits"]
        assert r["after_init"] < 0.3 * r["full_bytes"]              # 1/N while built
        assert len(r["losses"]) == 2 and all(map(math.isfinite, r["losses"]))


class ParentInitialisesChildren(nn.Module):
    """A parent whose __init__ initialises its (already partitioned) children through apply()."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 3)
        self.norm = nn.LayerNorm(3)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        import deepspeed.comm as dist

        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1.0 + dist.get_rank())   # ranks disagree: rank 0's values win
                module.bias.zero_()


def build_parent_initialised() -> dict:
    with deepspeed.zero.Init():
        model = ParentInitialisesChildren()
    applied_outside = model.apply(lambda m: None) is model   # apply is torch's own again
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"full": full, "weight_shard": model.linear.weight.ds_tensor.clone(), "outside": applied_outside,
            "apply_restored": nn.Module.apply.__module__ == "torch.nn.modules.module"}


@pytest.mark.parametrize("world", [1, 2])
def test_parent_apply_inside_init_reaches_partitioned_children(world: int) -> None:
    # upstream: weights set by a parent's apply(init_fn) inside zero.Init are those of rank 0 on
    # every rank (before, the fill landed on the empty placeholder and was lost)
    for result in run_distributed(world, build_parent_initialised):
        assert torch.equal(result["full"]["linear.weight"], torch.ones(3, 12))
        assert torch.equal(result["full"]["linear.bias"], torch.zeros(3))
        assert torch.equal(result["full"]["norm.weight"], torch.ones(3))
        assert result["weight_shard"].numel() == math.ceil(36 / world)
        assert torch.equal(result["weight_shard"], torch.ones(math.ceil(36 / world)))
        assert result["outside"] and result["apply_restored"]


class SkipInitChild(nn.Module):
    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.inner = nn.Linear(10, 10, device=device)


class SkipInitModel(nn.Module):
    """torch.nn.utils.skip_init: children built on the meta device, then materialised uninitialised."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.utils.skip_init(nn.Linear, 10, 10)
        self.l2 = nn.Linear(10, 10)
        self.l3 = torch.nn.utils.skip_init(SkipInitChild)


def build_skip_init() -> dict:
    with deepspeed.zero.Init():
        model = SkipInitModel()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"numel": {n: p.ds_tensor.numel() for n, p in model.named_parameters()}, "full": full}


def test_skip_init_inside_init_is_partitioned() -> None:
    results = run_distributed(2, build_skip_init)
    for result in results:
        assert result["numel"] == {"l1.weight": 50, "l1.bias": 5, "l2.weight": 50, "l2.bias": 5,
                                   "l3.inner.weight": 50, "l3.inner.bias": 5}
    for name, value in results[0]["full"].items():   # rank 0's (uninitialised) values on every rank
        assert torch.equal(value, results[1]["full"][name]) or torch.isnan(value).any(), name
