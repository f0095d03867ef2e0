"""engine.offload_states() / reload_states() at ZeRO stages 1-3 on real gloo ranks.

On a CPU machine "offloading to the CPU" changes no device, so every test forces the copy (the
move step is told the tensor is never already in place): each kind of state then gets new
storage, exactly as on an accelerator, and the tests check what could go wrong there: an alias
(a parameter, a fragment master, `ds_tensor`, an optimizer-state entry) left on the old storage,
values changed by the round trip, training that differs from a run that never offloaded, and
steps or forwards that silently run on offloaded state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from harness import run_distributed

STEPS, GAS = 3, 2


class Net(nn.Module):
    """Sizes that divide by neither 2 nor 4; a frozen layer (outside the optimizer's buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(15, 7)
        self.frozen = nn.Linear(7, 7)
        self.fc2 = nn.Linear(7, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.tanh(self.frozen(torch.relu(self.fc1(x))))), y)


def _config(stage: int, offload_optimizer: bool, bf16: bool, persistent: bool = True) -> dict:
    zero: dict = {"stage": stage}
    if not persistent:   # every ZeRO-3 unit released between uses (Net's are below the default threshold)
        zero["stage3_param_persistence_threshold"] = 0
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": zero, "bf16": {"enabled": bf16}}


def _slot_tensors(engine) -> dict:
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum, state_slots

    return {kind: [t for s in state_slots(engine, kind) if (t := s.get()) is not None]
            for kind in OffloadStateTypeEnum}


def _aliases(engine) -> list[torch.Tensor]:
    """Every tensor through which training reads the state: the parameters (and `ds_tensor`),
    the base optimizer's parameters (the fragment masters) and its state."""
    found = []
    for p in engine.module.parameters():
        found.append(p.data)
        if "ds_tensor" in p.__dict__:
            found.append(p.ds_tensor)
    base = engine.optimizer.optimizer
    for group in base.param_groups:
        found += [m.data for m in group["params"]]
    found += [v for state in base.state.values() for v in state.values() if torch.is_tensor(v)]
    return found


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _round_trip(engine, when: str) -> None:
    """Offload everything, check no alias is left on the old storage and every state is on the
    CPU, reload, check the values came back unchanged."""
    from deepspeed.runtime.zero.offload_states import get_state_devices

    before = _slot_tensors(engine)
    values = {k: [t.clone() for t in ts] for k, ts in before.items()}
    old = {_storage(t) for ts in before.values() for t in ts if t.numel()}   # held alive: no address reuse
    engine.offload_states()
    left = [tuple(t.shape) for t in _aliases(engine) if t.numel() and _storage(t) in old]
    assert not left, f"{when}: aliases still on the pre-offload storage: {left}"
    for kind, ts in before.items():
        if ts:
            assert get_state_devices(engine, kind) == {torch.device("cpu")}, (when, kind)
    engine.reload_states()
    after = _slot_tensors(engine)
    for kind in values:
        assert len(after[kind]) == len(values[kind]), (when, kind)
        for a, b in zip(after[kind], values[kind]):
            assert torch.equal(a, b), (when, kind)
    del before


class forced_copies:
    """Every move copies (see the module docstring); undone on exit (the worker pool is reused)."""

    def __enter__(self) -> None:
        from deepspeed.runtime.zero import offload_states

        self.saved = offload_states._already_there
        offload_states._already_there = lambda tensor, device: False

    def __exit__(self, *exc: object) -> None:
        from deepspeed.runtime.zero import offload_states

        offload_states._already_there = self.saved


def train(stage: int, offload_optimizer: bool, bf16: bool, persistent: bool, offload: bool) -> dict:
    if not offload:
        return _train(stage, offload_optimizer, bf16, persistent, False)
    with forced_copies():
        return _train(stage, offload_optimizer, bf16, persistent, True)


def _train(stage: int, offload_optimizer: bool, bf16: bool, persistent: bool, offload: bool) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    groups = [{"params": [p for n, p in net.named_parameters() if "bias" not in n and p.requires_grad]},
              {"params": [p for n, p in net.named_parameters() if "bias" in n and p.requires_grad],
               "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups,
                                      config=_config(stage, offload_optimizer, bf16, persistent))
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = torch.randn(2, 15, generator=gen).to(dtype), torch.randint(0, 5, (2,), generator=gen)
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.item())
            if offload and micro == 0:
                _round_trip(engine, f"step {step}, mid-accumulation")   # gradient buffers exist now
        if offload and step == 1:
            _round_trip(engine, f"step {step}, before step()")
        engine.step()
        if offload:
            _round_trip(engine, f"step {step}, after step()")
    masters = [s.master.float().clone() for s in
               (engine.optimizer.units if stage == 3 else engine.optimizer.buckets)]
    engine.destroy()
    return {"losses": losses, "masters": masters}


@pytest.mark.parametrize("stage,offload_optimizer,bf16,persistent", [
    (1, False, False, True), (2, False, True, True), (2, True, False, True),
    (3, False, False, False), (3, True, True, True), (3, True, False, False)])
def test_round_trip_leaves_training_unchanged(stage: int, offload_optimizer: bool, bf16: bool,
                                              persistent: bool) -> None:
    """Offloading and reloading at every point of a run (mid-accumulation, before and after
    the step) gives exactly the losses and master weights of the run that never offloaded: the
    round trip copies values, and the same kernels run in the same order."""
    world = 2
    plain = run_distributed(world, train, stage, offload_optimizer, bf16, persistent, False)
    moved = run_distributed(world, train, stage, offload_optimizer, bf16, persistent, True)
    for rank in range(world):
        assert moved[rank]["losses"] == plain[rank]["losses"]
        for a, b in zip(moved[rank]["masters"], plain[rank]["masters"]):
            assert torch.equal(a, b)


def guarded(stage: int) -> dict:
    with forced_copies():
        return _guarded(stage)


def _guarded(stage: int) -> dict:
    """What an offloaded engine refuses, and what it still does."""
    import deepspeed
    from deepspeed.runtime.zero import offload_states

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(stage, False, False, persistent=False))
    x, y = torch.randn(2, 15), torch.randint(0, 5, (2,))
    messages = {}
    for _ in range(GAS):                # one optimizer step: the optimizer state exists
        engine.backward(engine(x, y))
        engine.step()
    engine.backward(engine(x, y))
    engine.step()                       # micro-step 1 of 2: no optimizer step
    engine.optimizer.offload_states(include=["optim_states"])   # RLHF code calls it there (OpenRLHF)
    engine.backward(engine(x, y))       # forward and backward need no optimizer state
    try:
        engine.step()                   # the boundary: refused before anything changes
    except RuntimeError as error:
        messages["step"] = str(error)
    try:
        engine.optimizer.step()         # stepped directly, as Lightning Fabric does
    except RuntimeError as error:
        messages["optimizer_step"] = str(error)
    engine.reload_states()
    engine.step()                       # the same step, now taken
    messages["global_steps"] = engine.global_steps
    engine.offload_states(include=["lp_params"], pin_memory=False)
    try:
        with torch.no_grad():
            messages["forward_output"] = engine(x, y).item()
    except RuntimeError as error:
        messages["forward"] = str(error)
    engine.reload_states()
    for _ in range(GAS):
        engine.backward(engine(x, y))
        engine.step()
    messages["global_steps_end"] = engine.global_steps
    # After a step there are no gradients: offloading them moves nothing and refuses nothing.
    engine.offload_states(include=["lp_grads"])
    messages["nothing_to_move"] = engine.offloaded_state_kinds()
    # A reload that fails half-way (an out-of-memory on the device, say) keeps the record: the
    # guards stay on and a second reload finishes the job.
    engine.offload_states(include=["optim_states"])
    moves, real_move = [0], offload_states._move

    def failing_move(*args, **kwargs):
        moves[0] += 1
        if moves[0] == 2:
            raise MemoryError("injected")
        return real_move(*args, **kwargs)

    offload_states._move = failing_move
    try:
        engine.reload_states()
    except MemoryError:
        messages["after_failed_reload"] = engine.offloaded_state_kinds()
    finally:
        offload_states._move = real_move
    engine.backward(engine(x, y))
    engine.step()                       # micro-step 1 of 2 (no optimizer step: not refused)
    engine.backward(engine(x, y))
    try:
        engine.step()
    except RuntimeError as error:
        messages["step_after_failed_reload"] = str(error)
    engine.reload_states()
    engine.step()
    messages["global_steps_retry"] = engine.global_steps
    for bad in ({"include": ["bogus"]}, {"device": "nvme"}):
        try:
            engine.offload_states(**bad)
        except ValueError as error:
            messages[next(iter(bad))] = str(error)
    assert engine.offloaded_state_kinds() == []
    engine.destroy()
    return messages


@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_state_is_refused_with_a_clear_error(stage: int) -> None:
    messages = run_distributed(2, guarded, stage)[0]
    assert "reload_states()" in messages["step"] and "optim_states" in messages["step"]
    assert "optim_states" in messages["optimizer_step"]
    assert (messages["global_steps"], messages["global_steps_end"], messages["global_steps_retry"]) == (2, 3, 4)
    assert messages["nothing_to_move"] == []
    assert [k.value for k in messages["after_failed_reload"]] == ["optim_states"]
    assert "optim_states" in messages["step_after_failed_reload"]
    if stage == 3:   # a ZeRO-3 gather copies the shard to the device: forward works
        assert "forward" not in messages and "forward_output" in messages
    else:
        assert "reload_states()" in messages["forward"] and "lp_params" in messages["forward"]
    assert "'bogus'" in messages["include"] and "optim_states" in messages["include"]
    assert "'nvme'" in messages["device"] and "cpu" in messages["device"]


def no_zero() -> str:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=Net(), config=_config(0, False, False))
    try:
        engine.offload_states()
    except NotImplementedError as error:
        return str(error)
    return "no error"


def test_stage_0_is_refused_naming_the_stage() -> None:
    assert "zero_optimization.stage=0" in run_distributed(1, no_zero)[0]
