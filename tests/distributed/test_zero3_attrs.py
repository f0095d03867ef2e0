"""Upstream's ZeRO-3 parameter attributes after deepspeed.initialize, on a model whose parameter
sizes no world size divides (models_zero3.OddNet), at world sizes 1, 2 and 4:

- `ds_tensor` is the parameter's own partition: ceil(numel/N) elements, elements [r*s, (r+1)*s)
  of the flattened parameter on rank r, zero-padded, a view of the unit's shard; all ranks'
  pieces concatenated and trimmed are the parameter. `ds_numel`, `ds_shape`, `ds_numel_aligned`,
  `partition_numel()`, `padding_size()`, `aligned_size()`, `ds_tensor.ds_numel` have upstream's
  values (partition_parameters.py: padding = N - numel % N when that is nonzero);
- a write to `ds_tensor` on every rank is what the next gather shows (upstream's tests do
  `param.ds_tensor.data.copy_(x)` and then read the parameter inside GatheredParameters);
- training still equals plain PyTorch (1e-6), and each backward reduce-scatters every trainable
  unit once, padded per parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_distributed
from models_zero3 import build
from test_engine_dp import _config
from test_zero3_parity import _check, _run

WORLDS = [1, 2, 4]


def _engine(persistence: int = 0, offload: bool = False, init: bool = False):
    import deepspeed

    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    config = _config(micro=2, zero_optimization=zero)
    if init:
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(config)):
            model = build("odd")
    else:
        model = build("odd")
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def _attrs(persistence: int, offload: bool, init: bool) -> dict:
    """Runs on every rank: each parameter's upstream attributes and a copy of its ds_tensor."""
    from deepspeed.runtime.zero.stage3.sharded_param import unit_of

    engine = _engine(persistence, offload, init)
    out = {}
    for name, p in engine.module.named_parameters():
        unit = unit_of(p)
        shard_storage = unit.shard.untyped_storage().data_ptr()
        out[name] = {"tensor": p.ds_tensor.detach().clone(), "ds_numel": p.ds_numel, "ds_shape": tuple(p.ds_shape),
                     "tensor_ds_numel": p.ds_tensor.ds_numel, "partition_numel": p.partition_numel(),
                     "padding_size": p.padding_size(), "aligned_size": p.aligned_size(),
                     "ds_numel_aligned": p.ds_numel_aligned, "persist": p.ds_persist, "status": p.ds_status.name,
                     "view_of_shard": p.ds_tensor.untyped_storage().data_ptr() == shard_storage,
                     "id": p.ds_id}
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["plain", "persistent", "offload", "zero.Init"])
def test_ds_tensor_is_the_parameters_own_partition(world: int, variant: str) -> None:
    persistence = 10 ** 6 if variant == "persistent" else 0
    results = run_distributed(world, _attrs, persistence, variant == "offload", variant == "zero.Init")
    full = dict(build("odd").named_parameters())
    for name, p in full.items():
        numel, size = p.numel(), -(-p.numel() // world)
        remainder = numel % world
        padding = world - remainder if remainder else 0        # upstream's _padding_size
        assert size * world == numel + padding
        pieces = []
        for rank, r in enumerate(results):
            a = r[name]
            assert a["tensor"].numel() == size == a["tensor_ds_numel"] == a["partition_numel"], (name, rank, a)
            assert a["ds_numel"] == numel and a["ds_shape"] == tuple(p.shape), (name, a)
            assert a["padding_size"] == padding and a["aligned_size"] == a["ds_numel_aligned"] == numel + padding
            assert a["view_of_shard"], f"{name}: ds_tensor is not a view of the unit's shard"
            assert a["persist"] == (variant == "persistent")
            assert a["status"] == ("AVAILABLE" if variant == "persistent" else "NOT_AVAILABLE")
            mine = p.detach().reshape(-1)[rank * size:(rank + 1) * size]
            torch.testing.assert_close(a["tensor"][:mine.numel()], mine, rtol=0, atol=0)
            assert not a["tensor"][mine.numel():].any(), f"{name} rank {rank}: padding is not zero"
            pieces.append(a["tensor"])
        torch.testing.assert_close(torch.cat(pieces)[:numel].view(p.shape), p.detach(), rtol=0, atol=0)
    ids = [a["id"] for a in results[0].values()]
    assert len(set(ids)) == len(ids)


def _write_then_gather(offload: bool, how: str = "copy") -> dict:
    """Every rank writes its piece of a known value into each ds_tensor (in place, or by
    rebinding `ds_tensor.data` as upstream's partitioning tests do), then gathers."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(offload=offload)
    params = dict(engine.module.named_parameters())
    wanted = {}
    for k, (name, p) in enumerate(params.items()):
        value = torch.arange(p.ds_numel, dtype=torch.float32) + 1000 * (k + 1)
        wanted[name] = value.view(p.ds_shape)
        size = p.partition_numel()
        piece = torch.zeros(size)
        mine = value[rank * size:(rank + 1) * size]
        piece[:mine.numel()] = mine
        if how == "copy":
            p.ds_tensor.data.copy_(piece)
        else:
            p.ds_tensor.data = piece.to(p.ds_tensor.dtype)
    seen = {}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, p in params.items():
            seen[name] = p.detach().clone()
    # the full-state getters read the shards too
    from deepspeed.utils import safe_get_full_fp32_param

    full = {name: safe_get_full_fp32_param(p) for name, p in params.items()}
    # and a forward gathers them: the loss of a model whose weights are the written values
    x, y = torch.randn(2, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([1, 2])
    loss = engine(x, y).item()
    return {"wanted": wanted, "seen": seen, "loss": loss, "fp32": full}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("offload,how", [(False, "copy"), (True, "copy"), (False, "rebind"), (True, "rebind")])
def test_writes_to_ds_tensor_are_seen_after_gather(world: int, offload: bool, how: str) -> None:
    results = run_distributed(world, _write_then_gather, offload, how)
    reference = build("odd")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(results[0]["wanted"][name])
    x, y = torch.randn(2, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([1, 2])
    expected_loss = reference(x, y).item()
    for r in results:
        for name, value in r["wanted"].items():
            torch.testing.assert_close(r["seen"][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert r["loss"] == pytest.approx(expected_loss, rel=1e-6)
        # the fp32 masters are the optimizer's, not the shard's: upstream's ds_tensor writes do
        # not reach them either (the next step overwrites the shard from the masters)
        assert set(r["fp32"]) == set(r["wanted"])


@pytest.mark.parametrize("world,gas", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_odd_sizes_train_like_plain_pytorch(world: int, gas: int) -> None:
    config = _config(micro=2, gas=gas, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    _check(*_run(world, "odd", config, steps=4))


def _counted_initialize_and_save(save_dir: str, persistence: int) -> dict:
    """Build OddNet under zero.Init, count the collectives of initialize and of save_checkpoint
    (one frozen parameter), and return what the files' frozen pieces are."""
    import deepspeed
    import deepspeed.comm as dist

    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence}
    config = _config(micro=2, zero_optimization=zero)
    with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(config)):
        model = build("odd")
    model.mix.weight.requires_grad_(False)
    init_pieces = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}
    dist.comms_counter.reset()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    at_init = {op: s["count"] for op, s in dist.comms_counter.summary().items()}
    after = {n: p.ds_tensor.clone() for n, p in engine.module.named_parameters()}
    dist.comms_counter.reset()
    engine.save_checkpoint(save_dir, tag="t")
    at_save = {op: s["count"] for op, s in dist.comms_counter.summary().items()}
    return {"init": at_init, "save": at_save, "before": init_pieces, "after": after,
            "persistent_units": sum(u.spec.persistent for u in engine._stage3.units)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("persistence", [0, 10 ** 6])
def test_zero_init_pieces_are_kept_and_checkpoints_move_nothing(tmp_path, world: int, persistence: int) -> None:
    """initialize keeps zero.Init's slices as the units' pieces: no all-gather per parameter (a
    persistent unit is gathered once); save_checkpoint re-cuts nothing across ranks (no
    all-to-all) and writes the frozen parameter's pieces without gathering its unit."""
    results = run_distributed(world, _counted_initialize_and_save, str(tmp_path), persistence)
    for rank, r in enumerate(results):
        assert r["init"].get("all_gather_into_tensor", 0) == r["persistent_units"], r["init"]
        for name, piece in r["before"].items():
            torch.testing.assert_close(r["after"][name], piece, rtol=0, atol=0)
        assert "all_to_all_single" not in r["save"] and "all_gather_into_tensor" not in r["save"], r["save"]
        saved = torch.load(tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", weights_only=False)
        torch.testing.assert_close(saved["frozen_param_fragments"]["mix.weight"], r["before"]["mix.weight"],
                                   rtol=0, atol=0)


def _grad_partitions() -> dict:
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad

    engine = _engine()
    x, y = torch.randn(2, 16, generator=torch.Generator().manual_seed(5 + dist.get_rank())), torch.tensor([1, 2])
    engine.backward(engine(x, y))
    parts = engine.optimizer.get_fp32_grad_partitions()
    params = engine.optimizer.model_param_groups
    full = {(g, i): safe_get_full_grad(p) for g, group in enumerate(params) for i, p in enumerate(group)}
    return {"parts": parts, "full": full, "sizes": {(g, i): (p.partition_numel(), p.ds_numel)
                                                    for g, group in enumerate(params) for i, p in enumerate(group)}}


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_grad_partitions_are_each_ranks_padded_piece_of_the_reduced_gradient(world: int) -> None:
    """Upstream's `optimizer.get_fp32_grad_partitions()`: [group][index] -> this rank's fp32 piece
    of the averaged gradient, ceil(numel/N) elements; the pieces in rank order are the gradient."""
    results = run_distributed(world, _grad_partitions)
    for key, (size, numel) in results[0]["sizes"].items():
        pieces = [r["parts"][key[0]][key[1]] for r in results]
        assert all(p.dtype == torch.float32 and p.numel() == size for p in pieces), key
        joined = torch.cat(pieces)
        torch.testing.assert_close(joined[:numel], results[0]["full"][key].reshape(-1).float(), rtol=0, atol=0)
        assert not joined[numel:].any(), key   # the padding is zero


def _all_gather_coalesced() -> dict:
    """Upstream's `param.all_gather_coalesced(params)` (its ZeRO++ checkpoint tests read the parameters
    that way): the parameters are whole after `wait()`, equal to what GatheredParameters shows; they stay
    gathered until empty_partition_cache() or the optimizer step frees them (as upstream's step does; the
    step refused a gathered unit before), and the next gather shows the stepped values."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _engine()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        expected = [p.detach().clone() for p in params]
    out = {"before": [p.ds_status.name for p in params]}
    params[0].all_gather_coalesced(params).wait()
    out["whole"] = all(torch.equal(p.data, e) for p, e in zip(params, expected))
    out["status"] = [p.ds_status.name for p in params]
    engine.empty_partition_cache()
    out["after_cache"] = [p.ds_status.name for p in params]
    params[0].all_gather_coalesced(params).wait()
    x, y = torch.randn(2, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([1, 2])
    engine.backward(engine(x, y))
    engine.step()   # the gathered units are freed, not refused
    out["after_step"] = [p.ds_status.name for p in params]
    with deepspeed.zero.GatheredParameters(params):
        stepped = [p.detach().clone() for p in params]
    params[0].all_gather_coalesced(params).wait()
    out["stepped"] = all(torch.equal(p.data, s) for p, s in zip(params, stepped)) and \
        not all(torch.equal(s, e) for s, e in zip(stepped, expected))
    out["not_available"] = ZeroParamStatus.NOT_AVAILABLE.name
    return out


def test_all_gather_coalesced_gathers_until_released() -> None:
    for r in run_distributed(2, _all_gather_coalesced):
        assert set(r["before"]) == {r["not_available"]} and set(r["status"]) == {"AVAILABLE"}, r
        assert r["whole"] and r["stepped"], r
        assert set(r["after_cache"]) == {r["not_available"]} and set(r["after_step"]) == {r["not_available"]}, r
