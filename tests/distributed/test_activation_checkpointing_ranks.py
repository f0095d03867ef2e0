"""deepspeed.checkpointing on real gloo processes: inside engines at ZeRO stages 0-3, with
partition_activations over a model-parallel group of 2, and with two engines in one process.

Bit equality (rtol=0, atol=0) between checkpointed and plain training: the recompute runs the
same kernels on the same values (replayed RNG states give the same dropout masks), the region's
backward then runs the same kernels, and every tensor outside a region receives at most two
gradient contributions (one commutative addition). At 2 ranks a gradient is reduced in one
commutative addition too. So both runs do the same floating-point operations; see [Note: bit
equality in tests] in tests/README.md. Partitioned inputs are gathered back exactly (data moved).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from harness import run_distributed

EXACT = dict(rtol=0.0, atol=0.0)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc2(F.gelu(self.fc1(h))))


class Net(nn.Module):
    """inp -> 2 dropout blocks (checkpointed when `kind` is set) -> head."""

    def __init__(self, kind: str | None, dim: int = 16) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, dim), nn.Linear(dim, 4)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.kind = kind

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import deepspeed

        fn = {"reentrant": deepspeed.checkpointing.checkpoint,
              "non_reentrant": deepspeed.checkpointing.non_reentrant_checkpoint}.get(self.kind)
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = fn(block, h) if fn is not None else block(h)
        return F.cross_entropy(self.head(h), y)


def _config(stage: int, gas: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": zero}


def _released_during_recompute(engine) -> list[list[bool]]:
    """At each block's recompute (a forward inside backward), whether the *other* block's
    parameters are released (shards only): recomputed parameters must not pile up."""
    from deepspeed.runtime.zero.stage3 import ZeroParamStatus

    seen: list[list[bool]] = []
    blocks = list(engine.module.blocks)

    def pre_hook(module, args):
        if torch._C._current_graph_task_id() != -1:   # inside a backward: the recompute
            seen.append([all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in other.parameters())
                         for other in blocks if other is not module])

    for block in blocks:
        block.register_forward_pre_hook(pre_hook)
    return seen


def train(stage: int, kind: str | None, steps: int = 2, gas: int = 2) -> dict:
    """Runs on every rank. Micro-step 0 of each step uses engine.backward, the others loss.backward()."""
    import deepspeed
    import deepspeed.comm as dist

    from deepspeed.runtime.activation_checkpointing import state

    rank = dist.get_rank()
    state.PROCESS.stats = state.CheckpointStats()   # the workers persist across tests
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(kind), config=_config(stage, gas))
    released = _released_during_recompute(engine) if (stage == 3 and kind) else []
    torch.manual_seed(100 + rank)   # dropout masks differ per rank, equal between the two runs
    data = torch.Generator().manual_seed(rank)
    losses, gathers = [], 0
    for _ in range(steps):
        for micro in range(gas):
            x, y = torch.randn(2, 8, generator=data), torch.randint(0, 4, (2,), generator=data)
            loss = engine(x, y)
            before = dist.comms_counter.summary().get("all_gather_into_tensor", {}).get("count", 0)
            engine.backward(loss) if micro == 0 else loss.backward()
            gathers += dist.comms_counter.summary().get("all_gather_into_tensor", {}).get("count", 0) - before
            losses.append(loss.detach())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    stats = engine._activation_checkpointing.stats if engine._activation_checkpointing else None
    process_stats = copy.copy(deepspeed.checkpointing.stats())
    live = [p.numel() for p in engine.module.parameters()] if stage == 3 else []
    engine.destroy()
    return {"losses": losses, "params": params, "released": released, "backward_gathers": gathers,
            "live_numel": live, "stats": stats, "process_forwards": process_stats.forwards}


@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_training_bit_equal_to_plain(stage: int, kind: str) -> None:
    plain = run_distributed(2, train, stage, None)
    ckpt = run_distributed(2, train, stage, kind)
    for p, c in zip(plain, ckpt):
        for a, b in zip(p["losses"] + p["params"], c["losses"] + c["params"]):
            torch.testing.assert_close(b, a, **EXACT)
        assert c["process_forwards"] == 2 * 2 * 2     # 2 steps x gas 2 x 2 blocks, no engine section
    if stage == 3:
        for p, c in zip(plain, ckpt):
            # reentrant: the forward ran under no_grad, so the blocks' 4 units (fc1, fc2 of each)
            # were released after it and are gathered again for the recompute (and, as with
            # torch.utils.checkpoint(use_reentrant=True), once more for their backward): between
            # 1 and 2 gathers per unit and micro step. Non-reentrant keeps them from the forward.
            extra = c["backward_gathers"] - p["backward_gathers"]
            assert (4 * 4 <= extra <= 2 * 4 * 4) if kind == "reentrant" else extra == 0
            # block 1 is recomputed first; by block 0's recompute its parameters are shards again
            # (block 0 may already be gathered during block 1's: prefetch)
            assert len(c["released"]) == 8 and [r for (r,) in c["released"][1::2]] == [True] * 4
            assert all(n == 0 for n in c["live_numel"])


# --- partition_activations over a model-parallel group --------------------------------------------
class GroupMpu:
    """Megatron's mpu interface over real groups: every rank in one model-parallel group of
    `world`, each its own data-parallel group."""

    def __init__(self) -> None:
        import deepspeed.comm as dist

        world = dist.get_world_size()
        self.mp_group = dist.new_group(list(range(world)))
        dp_groups = [dist.new_group([r]) for r in range(world)]   # every rank creates every group
        self.dp_group = dp_groups[dist.get_rank()]

    def get_model_parallel_rank(self) -> int:
        import deepspeed.comm as dist
        return dist.get_rank(self.mp_group)

    def get_model_parallel_world_size(self) -> int:
        import deepspeed.comm as dist
        return dist.get_world_size(self.mp_group)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return self.dp_group


def partitioned(kind: str, options: dict) -> dict:
    """Runs on every rank: 3 checkpointed blocks on a [5, 7] activation (35 elements: padded to 36
    for 2 pieces), plain vs partitioned, then the same through an engine configured from its section."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.activation_checkpointing import state

    fn = {"reentrant": deepspeed.checkpointing.checkpoint,
          "non_reentrant": deepspeed.checkpointing.non_reentrant_checkpoint}[kind]
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(7) for _ in range(3))
    x = torch.randn(5, 7)   # the same on every rank, as model-parallel activations are

    def run(use_ckpt: bool) -> list[torch.Tensor]:
        for p in blocks.parameters():
            p.grad = None
        h = x.clone().requires_grad_()
        torch.manual_seed(3)
        out = h
        for b in blocks:
            out = fn(b, out) if use_ckpt else b(out)
        dist.comms_counter.reset()
        out.square().sum().backward()
        return [out.detach(), h.grad] + [p.grad.clone() for p in blocks.parameters()]

    mpu = GroupMpu()
    ref = run(False)
    owner = state.ActivationCheckpointing()
    owner.configure(mpu, state.settings_from(None, {"partition_activations": True, **options}))
    with state.activated(owner):
        got = run(True)
    gathered = dist.comms_counter.summary().get("all_gather_into_tensor", {})
    return {"equal": all(torch.equal(a, b) for a, b in zip(ref, got)), "stats": copy.copy(owner.stats),
            "gather_count": gathered.get("count"), "gather_bytes": gathered.get("bytes"),
            "buffer_numel": owner.buffer.flat.numel() if owner.buffer is not None else None,
            "buffer_next": owner.buffer.next_slot if owner.buffer is not None else None}


@pytest.mark.parametrize("options", [{}, {"contiguous_checkpointing": True, "num_checkpoints": 3},
                                     {"checkpoint_in_cpu": True}], ids=["plain", "contiguous", "cpu"])
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_partition_activations_mp2(kind: str, options: dict) -> None:
    for r in run_distributed(2, partitioned, kind, options):
        assert r["equal"]
        s = r["stats"]
        assert s.forwards == 3 and s.input_nbytes == 3 * 35 * 4
        assert s.kept_nbytes == 3 * 18 * 4                       # one padded half per region and rank
        assert (r["gather_count"], r["gather_bytes"]) == (3, 3 * 36 * 4)   # counted by deepspeed.comm
        if "num_checkpoints" in options:
            assert r["buffer_numel"] == 3 * 18 and r["buffer_next"] == 0  # one buffer; slots given back


def engine_partitioned() -> dict:
    """An engine with an mpu (model-parallel 2) and an activation_checkpointing section."""
    import deepspeed
    import deepspeed.comm as dist

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                        "number_checkpoints": 2}}
    engine, *_ = deepspeed.initialize(model=Net("reentrant"), config=cfg, mpu=GroupMpu())
    data = torch.Generator().manual_seed(0)   # model-parallel ranks see the same batch
    x, y = torch.randn(2, 8, generator=data), torch.randint(0, 4, (2,), generator=data)
    dist.comms_counter.reset()
    engine.backward(engine(x, y))
    stats = copy.copy(engine._activation_checkpointing.stats)
    gathers = dist.comms_counter.summary().get("all_gather_into_tensor", {}).get("count")
    engine.destroy()
    return {"stats": stats, "gathers": gathers, "process_forwards": deepspeed.checkpointing.stats().forwards}


def test_engine_configures_from_its_section() -> None:
    for r in run_distributed(2, engine_partitioned):
        s = r["stats"]
        assert s.forwards == 2 and s.recomputes == 2 and s.kept_nbytes * 2 == s.input_nbytes
        assert r["gathers"] == 2


def two_engines() -> dict:
    """Two engines in one process with different sections, forwards and backwards interleaved."""
    import deepspeed

    torch.manual_seed(0)
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    a, *_ = deepspeed.initialize(model=Net("reentrant"), config={
        **base, "activation_checkpointing": {"synchronize_checkpoint_boundary": True}})
    b, *_ = deepspeed.initialize(model=Net("non_reentrant"), config={
        **base, "activation_checkpointing": {"profile": True}})
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    loss_a, loss_b = a(x, y), b(x, y)
    a.backward(loss_a)
    b.backward(loss_b)
    out = {"a": copy.copy(a._activation_checkpointing.stats), "b": copy.copy(b._activation_checkpointing.stats),
           "a_profile": a._activation_checkpointing.settings.profile,
           "b_sync": b._activation_checkpointing.settings.synchronize}
    a.destroy(), b.destroy()
    return out


def test_two_engines_do_not_interfere() -> None:
    (r,) = run_distributed(1, two_engines)
    assert (r["a"].forwards, r["a"].recomputes, r["a"].synchronizations) == (2, 2, 8)
    assert (r["b"].forwards, r["b"].recomputes, r["b"].synchronizations) == (2, 2, 0)
    assert not r["a_profile"] and not r["b_sync"]
