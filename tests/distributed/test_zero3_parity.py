"""ZeRO-3 parity matrix, fp32: models whose structure stresses the gather/reduce schedule.

Stage 3 with every parameter sharded (`stage3_param_persistence_threshold: 0`) through
deepspeed.initialize must train exactly like a plain single-process PyTorch loop on the same
global batches (models_zero3.reference), within 1e-6:

- the example GPT (tied LM head, LayerNorm, SDPA), gradient accumulation 1 and 4, worlds 2 and 4;
- TiedNet (an embedding that is also the head) with accumulation 4, worlds 2 and 4;
- a branch taken on some micro steps only, the same on every rank (its unit gets a gradient on
  some steps, a zero one on others);
- a top-1 mixture of experts with data-dependent routing marked as a ZeRO-3 leaf in each of the
  supported ways (class, class name, module name, name suffix, and the same through the config),
  with ranks routing to different experts and some experts getting no token on some rank; and
  the case where one rank's tokens reach every expert while another's reach only some, so the
  leaf's parameters all have gradients mid-backward on one rank and never on the other (before
  leaf units were reduced by module, the ranks then reduce-scattered different units at the same position: gloo aborted a
  worker with "2244 vs 272. Received data size doesn't match expected size");
- reentrant activation checkpointing, of the blocks only and of every module (all gradients then
  come from nested backward calls, each a graph task of its own), accumulation 1 and 4.

Besides the numbers, on every rank: each parameter moved from its initial value, the ZeRO-3
collectives are the same on every rank and (static graphs) in every step, and each backward
reduce-scatters every trainable unit exactly once (once, with every module checkpointed and the root not
hooked, the end-of-backward epilogue ran at the end of each nested backward: 4x the gradient traffic).

Already covered elsewhere: TinyMLP at worlds 1/2/4 (test_zero3_engine.py), persistence and
offload variants, prefetch on/off (test_zero3_prefetch.py).
Each rank bounds ZeRO-3 collectives at 20 s (watchdog), so a divergence fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

from harness import run_distributed
from models import micro_slice
from models_zero3 import BranchNet, build, batches, reference, state_of
from test_engine_dp import _config

STEPS = 5
RTOL = ATOL = 1e-6

# [Note: SGD for the deeper models]
# The GPT and the checkpointed net train with SGD + momentum, not AdamW. They have gradient
# entries orders of magnitude below the typical size (the GPT's attention key bias gets exactly
# zero mathematically: it is why the tiny GPT has no biases), and Adam scales every entry's
# update to ~lr, so the rounding differences of any other reduction order (over ranks, over
# micro steps) grow into ~1e-5 parameter differences: stage 0 differs from the reference by as
# much. SGD is linear in the gradient, so 1e-6 holds, and it sees what Adam hides (a gradient
# off by a constant factor). The shallow models keep AdamW, whose weight decay also checks that
# a parameter without a gradient in a step is still stepped (with a zero gradient).
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def _z3(**extra: Any) -> dict:
    return {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}


def _mark_leaf(model: torch.nn.Module, how: str) -> None:
    """Flag the MoE as a ZeRO-3 leaf through the Python API (the config variants need nothing here)."""
    from deepspeed.utils import set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    from models_zero3 import ToyMoE

    if how == "class":
        set_z3_leaf_modules(model, [ToyMoE])
    elif how == "class-name":
        set_z3_leaf_modules(model, ["ToyMoE"])
    elif how == "name":
        set_z3_leaf_modules_by_name(model, ["block.moe"])
    elif how == "suffix":
        set_z3_leaf_modules_by_suffix(model, ["moe"])


def train(name: str, config: dict, steps: int, model_kwargs: dict | None = None, data: dict | None = None,
          leaf: str | None = None) -> dict:
    """Runs on every rank: `steps` global steps of model `name` through the engine. Returns the
    global-mean losses, the gathered final state, ZeRO-3 collectives per global step, and what
    the model recorded (expert usage, branch decisions)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import watchdog
    from deepspeed.utils import z3_leaf_module

    previous = watchdog.configure(timeout_s=20)   # a divergence fails within seconds, not minutes
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = build(name, **(model_kwargs or {}))
        if leaf is not None:
            _mark_leaf(model, leaf)
        engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config))
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        losses, collectives, reduced = [], [], []
        for x, y in batches(name, steps, micro, gas, world, **(data or {})):
            dist.comms_counter.reset()
            total = 0.0
            for k in range(gas):
                loss = engine(micro_slice(x, micro, k, rank, world), micro_slice(y, micro, k, rank, world))
                engine.backward(loss)
                engine.step()
                total += loss.item()
            summary = dist.comms_counter.summary()
            collectives.append(tuple(summary.get(op, {}).get("count", 0) for op in COLLECTIVES))
            reduced.append(summary.get("reduce_scatter_tensor", {}).get("numel", 0))
            mean = torch.tensor([total / gas])
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        stage3 = engine._stage3
        with stage3.gathered() if stage3 is not None else contextlib.nullcontext():
            state = state_of(engine.module)
        # one reduction of every trainable unit per backward: gas x the units' flat sizes, each
        # parameter padded to a multiple of N (its per-rank pieces are upstream's ds_tensor)
        trainable = [u.spec for u in stage3.units if u.trainable] if stage3 is not None else []
        once = gas * sum(-(-n // world) * world for spec in trainable for n in spec.numels)
        out = {"losses": losses, "state": state, "collectives": collectives, "reduced": reduced, "once": once,
               "global_steps": engine.global_steps}
        if name == "moe":
            moe = engine.module.block.moe
            out["usage"] = torch.tensor(moe.usage).sum(0).tolist()
            out["leaf"] = z3_leaf_module(moe)
            out["owners"] = [u.spec.owner for u in stage3.units] if stage3 is not None else []
        if name == "branch":
            out["taken"] = engine.module.taken
        return out
    finally:
        watchdog.configure(**dataclasses.asdict(previous))


def _check(results: list[dict], ref: dict, rtol: float = RTOL, atol: float = ATOL, static: bool = True) -> None:
    """Every rank: losses and every final parameter equal the reference's; the parameters moved;
    the same ZeRO-3 collectives as the other ranks, the same in every step for a `static` graph;
    every trainable unit's gradient reduce-scattered exactly once per backward."""
    initial = ref["initial"]
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert r["state"].keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
            if value.is_floating_point():
                assert not torch.equal(value, initial[name]), f"{name} did not train"
        assert r["collectives"] == results[0]["collectives"], [r["collectives"] for r in results]
        assert not static or len(set(r["collectives"])) == 1, f"rank {rank}: per step {r['collectives']}"
        assert all(c > 0 for c in r["collectives"][0]), r["collectives"]
        assert all(n == r["once"] for n in r["reduced"]), \
            f"rank {rank}: reduce-scattered {r['reduced']} elements per step, {r['once']} expected"


def _run(world: int, name: str, config: dict, steps: int = STEPS, model_kwargs: dict | None = None,
         data: dict | None = None, leaf: str | None = None) -> tuple[list[dict], dict]:
    results = run_distributed(world, train, name, config, steps, model_kwargs, data, leaf)
    return results, reference(name, config, steps, world, model_kwargs, data)


# --- GPT and tied embeddings ---------------------------------------------------------------------

@pytest.mark.parametrize("world,gas", [(2, 1), (2, 4), (4, 4)])
def test_gpt_equals_plain_pytorch(world: int, gas: int) -> None:
    """SGD with momentum: see [Note: SGD for the deeper models]."""
    config = _config(micro=2, gas=gas, opt="SGD", zero_optimization=_z3())
    results, ref = _run(world, "gpt", config, steps=4)
    _check(results, ref)
    assert "lm_head.weight" in ref["state"] and results[0]["global_steps"] == 4
    torch.testing.assert_close(results[0]["state"]["lm_head.weight"], results[0]["state"]["tok_emb.weight"],
                               rtol=0, atol=0)   # still tied after training


@pytest.mark.parametrize("world", [2, 4])
def test_tied_embeddings_gas_4_equals_plain_pytorch(world: int) -> None:
    config = _config(micro=2, gas=4, zero_optimization=_z3())
    _check(*_run(world, "tied", config))


# --- a branch taken on some micro steps only -----------------------------------------------------

def test_branch_on_some_steps_equals_plain_pytorch_and_stage_0() -> None:
    """The branch runs on calls 1, 6, 7 and 13 of 20 (gas 4): global steps 0, 1 and 3 use it on
    some micro steps, steps 2 and 4 never (then `extra` is stepped with a zero gradient)."""
    config = _config(micro=2, gas=4, zero_optimization=_z3())
    results, ref = _run(2, "branch", config)
    _check(results, ref, static=False)   # steps without the branch gather fewer units
    expected = [i in BranchNet.TAKEN for i in range(STEPS * 4)]   # taken and skipped, as planned
    assert all(r["taken"] == expected for r in results) and ref["model"].taken == expected
    stage0 = run_distributed(2, train, "branch", _config(micro=2, gas=4, zero_optimization={"stage": 0}), STEPS)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(stage0[0]["losses"]), rtol=RTOL, atol=ATOL)
        for name, value in stage0[0]["state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)


# --- mixture of experts as a ZeRO-3 leaf ---------------------------------------------------------

LEAF_CONFIGS = {"config-classes": {"classes": ["ToyMoE"]}, "config-names": {"names": ["block.moe"]},
                "config-suffixes": {"name_suffixes": ["moe"]}}
PARTIAL = ((0, 1, 1, 2), (2, 3))      # rank 0 never routes to expert 3, rank 1 never to experts 0 and 1
FULL_VS_PARTIAL = ((0, 1, 2, 3), (1, 2))   # rank 0 reaches every expert, rank 1 only experts 1 and 2


def _moe(experts: tuple[tuple[int, ...], ...], how: str, gas: int) -> tuple[list[dict], dict]:
    zero = _z3(leaf_module=LEAF_CONFIGS[how]) if how in LEAF_CONFIGS else _z3()
    config = _config(micro=4, gas=gas, zero_optimization=zero)
    results, ref = _run(2, "moe", config, data={"experts": experts},
                        leaf=None if how in LEAF_CONFIGS else how)
    usage = [r["usage"] for r in results]   # tokens per expert over the run, per rank
    for rank, used in enumerate(usage):   # the data decided the routing, as planned
        assert [e for e, n in enumerate(used) if n] == sorted(set(experts[rank])), usage
    assert usage[0] != usage[1] and any(0 in used for used in usage), usage
    for r in results:
        assert r["leaf"], "the MoE was not flagged as a leaf"
        assert "block.moe" in r["owners"] and not any(o.startswith("block.moe.") for o in r["owners"]), r["owners"]
    return results, ref


@pytest.mark.parametrize("how", ["class", "class-name", "name", "suffix", *LEAF_CONFIGS])
def test_moe_leaf_with_data_dependent_routing(how: str) -> None:
    """Every rank leaves some expert without tokens: the leaf's gradients are completed by the
    end-of-backward epilogue on both ranks."""
    _check(*_moe(PARTIAL, how, gas=1))


@pytest.mark.parametrize("gas", [1, 4])
def test_moe_leaf_one_rank_reaches_every_expert(gas: int) -> None:
    """Rank 0's tokens reach every expert, rank 1's only some: on rank 0 the leaf's gradient is
    complete in the middle of the backward (before `inp`'s), on rank 1 only at its end. The
    reduce-scatters must still pair up across ranks."""
    results, ref = _moe(FULL_VS_PARTIAL, "class", gas=gas)
    assert all(results[0]["usage"]) and not all(results[1]["usage"])
    _check(results, ref)


# --- reentrant activation checkpointing ----------------------------------------------------------

def _has_deepspeed_checkpointing() -> bool:
    try:
        return importlib.util.find_spec("deepspeed.checkpointing") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("everything", [False, True], ids=["blocks", "everything"])
@pytest.mark.parametrize("fn", ["torch", "deepspeed"])
def test_reentrant_activation_checkpointing(fn: str, everything: bool, gas: int) -> None:
    """`torch.utils.checkpoint(use_reentrant=True)`, and upstream's `deepspeed.checkpointing`
    (reentrant too) where this package has it. The end of a nested backward is not the end of the
    backward: `_check` sees a second reduction of any unit."""
    if fn == "deepspeed" and not _has_deepspeed_checkpointing():
        pytest.skip("deepspeed.checkpointing is not implemented in this package")
    config = _config(micro=2, gas=gas, opt="SGD", zero_optimization=_z3())   # see [Note: SGD for the deeper models]
    _check(*_run(2, "ckpt", config, model_kwargs={"fn": fn, "everything": everything}))
