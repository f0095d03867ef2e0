"""ZeRO stages 1 and 2: parity with stage 0 and plain PyTorch, sharded memory, communication volume."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from models import make_model, reference_training
from test_engine_dp import STEPS, _assert_matches_reference, _config, train_engine


PARITY_STEPS = 20


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("offload,overlap", [(False, True), (True, False)])
def test_zero_parity_with_plain_pytorch(stage: int, world: int, gas: int, offload: bool, overlap: bool) -> None:
    """20 steps of stage 1/2 (with/without CPU optimizer offload and overlap_comm) equal the reference."""
    zero = {"stage": stage, "reduce_bucket_size": 500, "overlap_comm": overlap}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = _config(micro=1, gas=gas, zero_optimization=zero)
    results = run_distributed(world, train_engine, config, PARITY_STEPS)
    ref_losses, ref_state, _ = reference_training(config, PARITY_STEPS, world)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
        for name, ref in ref_state.items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_zero_equals_stage_0() -> None:
    """Stages 1 and 2 give the same parameters as stage 0 trained the same way."""
    states = {}
    for stage in (0, 1, 2):
        config = _config(micro=1, gas=2, zero_optimization={"stage": stage, "reduce_bucket_size": 500})
        states[stage] = run_distributed(2, train_engine, config, 6)[0]["state"]
    for stage in (1, 2):
        for name, ref in states[0].items():
            torch.testing.assert_close(states[stage][name], ref, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clipping_and_sgd(stage: int) -> None:
    config = _config(micro=2, gas=2, opt="SGD", gradient_clipping=0.05, zero_optimization={"stage": stage})
    results = run_distributed(2, train_engine, config, STEPS)
    _assert_matches_reference(results, config, 2, clip=0.05)
    assert results[0]["grad_norm"] > 0.05


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_offload_optimizer_cpu(stage: int) -> None:
    config = _config(micro=2, gas=2, zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}})
    _assert_matches_reference(run_distributed(2, train_engine, config, STEPS), config, 2)


def zero_layout(stage: int, bucket: int) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    cfg = _config(micro=2, zero_optimization={"stage": stage, "reduce_bucket_size": bucket})
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=cfg)
    state_numel = 0
    engine.backward(engine(torch.randn(2, 16), torch.tensor([0, 1])))
    dist.comms_counter.reset()
    engine.step()
    step_comm = dist.comms_counter.summary()
    for value in opt.state.values():
        state_numel += sum(t.numel() for t in value.values() if torch.is_tensor(t) and t.dim() > 0)
    dist.comms_counter.reset()
    engine.backward(engine(torch.randn(2, 16), torch.tensor([0, 1])))
    backward_comm = dist.comms_counter.summary()
    return {"shard": opt.shard_numel(), "state": state_numel, "buckets": len(opt.buckets),
            "step_comm": step_comm, "backward_comm": backward_comm}


@pytest.mark.parametrize("world", [2, 4])
def test_zero_memory_and_communication_are_counted(world: int) -> None:
    results = run_distributed(world, zero_layout, 2, 600)
    numel = sum(p.numel() for p in make_model().parameters())
    r0 = results[0]
    # master shard: ceil(bucket/N) per bucket; AdamW keeps two states of the same size
    assert numel / world <= r0["shard"] <= numel / world + r0["buckets"]
    assert r0["state"] == 2 * r0["shard"]
    assert len({r["shard"] for r in results}) == 1  # equal shards on every rank
    # one reduce-scatter per bucket in backward, one all-gather per bucket in step: DDP's volume
    rs = r0["backward_comm"]["reduce_scatter_tensor"]
    ag = r0["step_comm"]["all_gather_into_tensor"]
    assert rs["count"] == r0["buckets"] and ag["count"] == r0["buckets"]
    padded = r0["shard"] * world
    ddp_wire = 2 * numel * 4 * (world - 1) / world
    assert rs["wire_bytes"] + ag["wire_bytes"] == pytest.approx(2 * padded * 4 * (world - 1) / world)
    assert rs["wire_bytes"] + ag["wire_bytes"] <= 1.02 * ddp_wire
    assert "all_reduce" not in r0["backward_comm"]


def _reachable_tensors() -> list:
    import gc

    gc.collect()
    return [obj for obj in gc.get_objects()
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel() > 1]


def _live_tensor_bytes(engine, opt, before: list) -> dict:
    """Bytes of the distinct tensor storages Python can reach (gc) that were not there before the
    engine (`before`, held alive so no new storage reuses their addresses: what earlier jobs in this
    worker left in libraries' globals is not the engine's), next to what the layout says a rank holds
    between steps: the parameters (4Ψ, fp32), the master shard and AdamW's two states (3 x 4 x shard).
    Asks no engine object what it holds beyond the sizes."""
    old = {t.untyped_storage().data_ptr() for t in before}
    storages: dict[int, int] = {}
    for obj in _reachable_tensors():
        storage = obj.untyped_storage()
        if storage.data_ptr() not in old:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    params = sum(sb.param_flat.numel() for sb in opt.buckets) * 4
    return {"counted": sum(storages.values()), "expected": params + 3 * 4 * opt.shard_numel()}


def stage2_gradient_memory(bucket: int, overlap: bool = True, stage: int = 2) -> dict:
    import deepspeed

    cfg = _config(micro=2, gas=2, zero_optimization={"stage": stage, "reduce_bucket_size": bucket,
                                                     "overlap_comm": overlap})
    before = _reachable_tensors()
    engine, opt, _, _ = deepspeed.initialize(model=make_model(), config=cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 16), torch.tensor([0, 1])))
        engine.step()
    reducer = engine._reducer
    sizes = [b.shard_numel * 2 for b in reducer.buckets]
    freed = all(b.shard_grad is None for b in reducer.buckets) and \
        all(m.grad is None for g in opt.optimizer.param_groups for m in g["params"])
    live = _live_tensor_bytes(engine, opt, before)
    return {"after_backward": reducer.live_buffer_numel(), "peak": reducer.peak_live_numel,
            "largest": max(sizes), "largest_two": sum(sorted(sizes)[-2:]), "total": sum(sizes),
            "grads_none": all(p.grad is None for p in engine.module.parameters()),
            "shards_freed": freed, "live": live,
            "state": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stage1_between_steps_holds_parameters_masters_and_state_only(world: int) -> None:
    for r in run_distributed(world, stage2_gradient_memory, 300, True, 1):
        assert r["after_backward"] == 0 and r["grads_none"] and r["shards_freed"]
        assert r["live"]["counted"] == r["live"]["expected"], r["live"]


def test_stage2_keeps_only_shards_between_backwards() -> None:
    """overlap_comm: one bucket filling while the previous one reduces (two alive); without it
    (upstream's stage 1/2 default) each bucket's reduce-scatter completes at launch: the shard plus
    at most one bucket (gradients here arrive in bucket order). The same numbers either way."""
    r = run_distributed(2, stage2_gradient_memory, 300)[0]
    assert r["after_backward"] == 0 and r["grads_none"]
    # between steps not even the gradient shards are left (upstream frees its averaged gradients
    # after the step too): parameters, master shard and optimizer state, counted by gc
    assert r["shards_freed"] and r["live"]["counted"] == r["live"]["expected"], r["live"]
    assert r["largest"] < r["peak"] <= r["largest_two"] < r["total"]  # one bucket filling, one reducing
    one = run_distributed(2, stage2_gradient_memory, 300, False)[0]
    assert one["after_backward"] == 0 and one["grads_none"]
    assert one["peak"] <= one["largest"]
    for name, value in r["state"].items():
        assert torch.equal(one["state"][name], value), name


def offload_optimizer_classes() -> list:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam


    out = []
    for zero in ({"stage": 2, "cpu_offload": True}, {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                 {"stage": 2}):
        for opt in ("Adam", "AdamW"):
            cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                   "optimizer": {"type": opt, "params": {"lr": 1e-3, "adam_w_mode": False}}}
            engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
            base = engine.optimizer.optimizer
            out.append((bool(zero.get("cpu_offload") or zero.get("offload_optimizer")), opt,
                        isinstance(base, DeepSpeedCPUAdam), isinstance(base, FusedAdam), base.adam_w_mode))
    return out


def test_optimizer_offload_builds_deepspeed_cpu_adam_as_upstream() -> None:
    """Upstream's rule (and its tests' isinstance checks): with offload_optimizer (or the legacy
    cpu_offload) an Adam config builds DeepSpeedCPUAdam; AdamW is AdamW whatever adam_w_mode says."""
    for offload, opt, cpu_adam, fused, w_mode in run_distributed(1, offload_optimizer_classes)[0]:
        assert (cpu_adam, fused) == (offload, not offload), (offload, opt)
        assert bool(w_mode) == (opt == "AdamW"), (offload, opt)
