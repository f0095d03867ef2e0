"""Data-parallel engine (ZeRO stage 0) against a plain-PyTorch reference on the same global batch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from harness import run_distributed
from models import SometimesUnused, TinyMLP, global_batches, make_model, micro_slice, reference_training

STEPS = 4


def _config(micro: int = 2, gas: int = 1, opt: str = "AdamW", **extra) -> dict:
    params = {"lr": 1e-2, "weight_decay": 0.01} if opt == "AdamW" else {"lr": 0.1, "momentum": 0.9}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": opt, "params": params}, "gradient_clipping": 0.0, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


def train_engine(config: dict, steps: int, style: str = "engine", model_cls: type = TinyMLP, edit=None) -> dict:
    """Runs on every rank; returns global-mean losses and final parameters. `edit(engine, step)`
    runs after initialize (step -1) and after every global step."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = deepspeed.initialize(model=make_model(cls=model_cls), config=copy.deepcopy(config))
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if edit is not None:
        edit(engine, -1)
    dist.comms_counter.reset()
    losses, first_grads = [], None
    for x, y in global_batches(steps, micro * gas * world):
        total = 0.0
        for k in range(gas):
            xb, yb = micro_slice(x, micro, k, rank, world), micro_slice(y, micro, k, rank, world)
            loss = engine(xb, yb)
            total += loss.item()
            if style == "engine":
                engine.backward(loss)
                if first_grads is None and engine.is_gradient_accumulation_boundary() and \
                        engine.zero_optimization_stage() == 0:
                    first_grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
                engine.step()
            elif style == "accelerate":  # boundary set before every backward, loss pre-divided, step at boundary
                engine.set_gradient_accumulation_boundary(k == gas - 1)
                engine.backward(loss / gas, scale_wrt_gas=False)
                if k == gas - 1:
                    engine.step()
            elif style == "torch":  # loss.backward() directly: the engine's output hooks scale by 1/gas
                loss.backward()
                engine.step()
            elif style == "nonscalar":  # out.backward(dloss/dout) on a non-scalar output
                out = engine(xb)
                probs = torch.softmax(out.detach(), dim=-1)
                grad = (probs - torch.nn.functional.one_hot(yb, probs.shape[-1]).float()) / yb.numel()
                out.backward(grad)
                engine.step()
        mean = torch.tensor([total / gas])
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if edit is not None:
            edit(engine, len(losses) - 1)
    comm = dist.comms_counter.summary()
    stage3 = getattr(engine, "_stage3", None)  # ZeRO-3: parameters are released shards between uses
    with stage3.gathered() if stage3 is not None else contextlib.nullcontext():
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "state": state, "first_grads": first_grads, "comm": comm, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
            "grad_norm": engine.get_global_grad_norm()}


def _assert_matches_reference(results: list[dict], config: dict, world: int, clip: float | None = None,
                              model_cls: type = TinyMLP, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    ref_losses, ref_state, ref_grads = reference_training(config, STEPS, world, model_cls=model_cls, clip=clip)
    for rank_result in results:
        if rank_result["first_grads"] is not None:  # averaged gradients, before any optimizer math
            for name, ref in ref_grads.items():
                torch.testing.assert_close(rank_result["first_grads"][name], ref, rtol=rtol, atol=atol / 10,
                                           msg=name)
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), torch.tensor(ref_losses),
                                   rtol=rtol, atol=atol)
        for name, ref in ref_state.items():
            torch.testing.assert_close(rank_result["state"][name], ref, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("gas", [1, 2, 4])
def test_parity_with_plain_pytorch(world: int, gas: int) -> None:
    config = _config(micro=2, gas=gas)
    results = run_distributed(world, train_engine, config, STEPS)
    _assert_matches_reference(results, config, world)
    assert results[0]["global_steps"] == STEPS
    assert results[0]["micro_steps"] == STEPS * gas
    assert results[0]["global_samples"] == STEPS * 2 * gas * world


def test_parity_world_4_sgd_momentum() -> None:
    config = _config(micro=1, gas=2, opt="SGD")
    _assert_matches_reference(run_distributed(4, train_engine, config, STEPS), config, 4)


@pytest.mark.parametrize("style", ["accelerate", "torch", "nonscalar"])
def test_other_accumulation_drivers(style: str) -> None:
    config = _config(micro=2, gas=2)
    _assert_matches_reference(run_distributed(2, train_engine, config, STEPS, style), config, 2)


def test_gradient_clipping_by_global_norm() -> None:
    config = _config(micro=2, gas=2, gradient_clipping=0.05)
    results = run_distributed(2, train_engine, config, STEPS)
    _assert_matches_reference(results, config, 2, clip=0.05)
    assert results[0]["grad_norm"] is not None and results[0]["grad_norm"] > 0.05  # clipping was active


@pytest.mark.parametrize("extra", [{"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                                   {"gradient_predivide_factor": 8.0}])
def test_prescale_and_predivide_average_the_same(extra: dict) -> None:
    config = _config(micro=2, gas=1, **extra)
    _assert_matches_reference(run_distributed(2, train_engine, config, STEPS), config, 2, rtol=1e-5, atol=1e-6)


def test_gradient_bytes_equal_ddp_and_one_reduction_per_boundary() -> None:
    config = _config(micro=2, gas=4)
    results = run_distributed(2, train_engine, config, STEPS)
    numel = sum(p.numel() for p in make_model().parameters())
    comm = results[0]["comm"]["all_reduce"]
    # The test's own loss all_reduce (one float per step) is the only other all_reduce.
    assert comm["bytes"] == STEPS * (numel * 4 + 4)
    assert comm["count"] == STEPS * 2  # one bucket (tiny model) + the loss, once per boundary only


def test_communication_data_type_halves_bytes() -> None:
    config = _config(micro=2, gas=1, communication_data_type="bf16")
    results = run_distributed(2, train_engine, config, STEPS)
    numel = sum(p.numel() for p in make_model().parameters())
    assert results[0]["comm"]["all_reduce"]["bytes"] == STEPS * (numel * 2 + 4)
    _assert_matches_reference(results, config, 2, rtol=2e-2, atol=2e-3)


def test_buckets_bound_collectives_and_overlap_order() -> None:
    config = _config(micro=2, gas=1, zero_optimization={"stage": 0, "reduce_bucket_size": 600})
    results = run_distributed(2, train_engine, config, STEPS)
    _assert_matches_reference(results, config, 2)
    sizes = [p.numel() for p in make_model().parameters()]
    count = results[0]["comm"]["all_reduce"]["count"] // STEPS - 1
    assert 2 <= count <= len(sizes)  # several buckets, never more than one per tensor


def unused_on_some_ranks(steps: int) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    rank = dist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(cls=SometimesUnused), config=_config(micro=2))
    for step in range(steps):
        x = torch.randn(2, 16)
        y = torch.tensor([rank + step, 1])  # rank parity decides whether `extra` runs
        engine.backward(engine(x, y))
        engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_parameter_unused_on_one_rank_does_not_hang() -> None:
    results = run_distributed(2, unused_on_some_ranks, 3, timeout=60)
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name])  # replicas stay identical


def no_sync_behaviour() -> dict:
    import deepspeed
    import deepspeed.comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(micro=2))
    x, y = torch.randn(2, 16) * (dist.get_rank() + 1), torch.tensor([0, 1])
    dist.comms_counter.reset()
    with engine.no_sync():
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match="inside no_sync context manager") as info:
            engine.step()
        assert isinstance(info.value, AssertionError)  # upstream asserts; user code catches that
    grads_local = [p.grad.clone() for p in engine.module.parameters()]
    reduced = dist.comms_counter.summary().get("all_reduce", {}).get("count", 0)
    return {"reduced": reduced, "grad": grads_local[0]}


def test_no_sync_skips_reduction() -> None:
    results = run_distributed(2, no_sync_behaviour)
    assert results[0]["reduced"] == 0
    assert not torch.allclose(results[0]["grad"], results[1]["grad"])  # still local, not averaged


def sum_or_mean_step(stage: int, op: str, extra: dict) -> list[float]:
    """One SGD(lr=1) step of a linear loss whose gradient is the input on every rank: the update
    is minus the combined gradient, so it shows whether ranks' gradients were summed or averaged."""
    import deepspeed

    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "gradient_allreduce_op": op, "zero_optimization": {"stage": stage, **extra.pop("zero", {})}, **extra}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=config)
    engine.backward(engine(torch.tensor([1.0, 2.0])).sum())
    engine.step()
    return engine.module.weight.detach().flatten().tolist()


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("op,combined", [("mean", 1.0), ("sum", 2.0)])
@pytest.mark.parametrize("extra", [{"zero": {"reduce_scatter": True, "contiguous_gradients": True}},
                                   {"gradient_predivide_factor": 2.0, "zero": {"reduce_scatter": False}},
                                   {"prescale_gradients": True, "zero": {"contiguous_gradients": False}}],
                         ids=["reduce_scatter", "predivide", "prescale"])
def test_gradient_allreduce_op_sum_and_mean(stage: int, op: str, combined: float, extra: dict) -> None:
    # 2 ranks, identical gradients [1, 2]: "mean" gives [1, 2], "sum" gives [2, 4], whatever the
    # prescale/predivide split (powers of two: exact in fp32)
    for weights in run_distributed(2, sum_or_mean_step, stage, op, copy.deepcopy(extra)):
        assert weights == [-1.0 * combined, -2.0 * combined]
