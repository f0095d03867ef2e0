"""ZeRO-3 parameters read outside their module through paths the torch-function detector used to
miss ([Note: automatic external parameters], [Note: gradients for released parameters]): the
pattern of TRL's fused LM-head loss, without TRL -- a custom `autograd.Function` handed another
module's parameter inside the model's forward, bare (released at `apply`) or inside a
GatheredParameters block, re-gathering it in its backward when it finds it released -- with and
without activation checkpointing, trained at world 2 against plain PyTorch on one process
(fp32, 1e-6); and the clear error where a gradient for a released parameter cannot be made whole.
Before the fix each variant failed in backward with `The size of tensor a (0) must match ...`
or `returned an invalid gradient at index 1 - got [4, 32] but expected shape compatible with [0]`."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import deepspeed
from harness import run_distributed
from models import reference_training
from test_engine_dp import _config, train_engine
from test_zero3_engine import _assert_close_to, _z3
from test_zero3_gathered import train_without_auto_external


class Project(torch.autograd.Function):
    """`h @ weight.T` with a hand-written backward that, like TRL's chunked log-prob kernel,
    gathers `weight` itself if it finds it released under ZeRO-3."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return h @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, weight = ctx.saved_tensors
        status = getattr(weight, "ds_status", None)
        with deepspeed.zero.GatheredParameters(weight, enabled=status is not None and status.name != "AVAILABLE"):
            return grad @ weight, grad.t() @ h


class FusedHead(nn.Module):
    """The root's forward projects through `head.weight` with `Project` (the head module never
    runs). `gathered`: inside GatheredParameters (TRL's maybe_gather_lm_head_ctx), else bare;
    `ckpt`: the body and the projection under activation checkpointing (None, "nonreentrant",
    "reentrant")."""

    gathered, ckpt = False, None

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4, bias=False)

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(h))
        weight = self.head.weight
        with deepspeed.zero.GatheredParameters(weight, enabled=self.gathered):
            return Project.apply(h, weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.ckpt is None:
            logits = self._tail(h)
        else:
            logits = checkpoint(self._tail, h, use_reentrant=self.ckpt == "reentrant")
        return logits if y is None else F.cross_entropy(logits, y)


class Bare(FusedHead):
    pass


class Gathered(FusedHead):
    gathered = True


class BareCkpt(FusedHead):
    ckpt = "nonreentrant"


class GatheredCkpt(FusedHead):
    gathered, ckpt = True, "nonreentrant"


class GatheredReentrant(FusedHead):
    gathered, ckpt = True, "reentrant"


def registered_on_root(engine, step: int) -> None:
    """After the first step the root holds head.weight as an external parameter."""
    from deepspeed.runtime.zero.stage3.units import external_parameters

    if step == 0:
        found = [p is engine.module.head.weight for p in external_parameters(engine.module)]
        assert found == [True], found


@pytest.mark.parametrize("model_cls", [Bare, Gathered, BareCkpt, GatheredCkpt, GatheredReentrant])
def test_custom_function_reading_another_modules_parameter_trains_like_plain_pytorch(model_cls) -> None:
    # released after every forward (nothing kept for the backward): the read certainly meets a
    # released placeholder or a unit that only the GatheredParameters block holds
    config = _config(micro=2, gas=2, zero_optimization=_z3(stage3_max_reuse_distance=0))
    results = run_distributed(2, train_engine, config, 4, "engine", model_cls, registered_on_root)
    ref_losses, ref_state, _ = reference_training(config, 4, 2, model_cls=model_cls)
    _assert_close_to(results, ref_losses, ref_state)


def test_gradient_for_a_released_parameter_is_gathered_when_nothing_registered_it() -> None:
    """Detection off: the GatheredParameters block is the only gather in the forward; the
    gradient arrives after it released the weight, and the parameter is gathered again there."""
    config = _config(micro=2, gas=2, zero_optimization=_z3(stage3_max_reuse_distance=0))
    results = run_distributed(2, train_without_auto_external, config, 4, "engine", Gathered)
    ref_losses, ref_state, _ = reference_training(config, 4, 2, model_cls=Gathered)
    _assert_close_to(results, ref_losses, ref_state)


class LeafOutside(nn.Module):
    """A z3 leaf whose weight the caller reads after the forward, in a GatheredParameters block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.leaf = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x))


def leaf_gradient_refused() -> str:
    from deepspeed.runtime.zero.stage3 import Stage3Coordinator
    from deepspeed.utils import set_z3_leaf_modules

    torch.manual_seed(0)
    model = LeafOutside()
    set_z3_leaf_modules(model, [nn.Linear])
    Stage3Coordinator(model, max_reuse_distance=0)
    h = model(torch.ones(2, 8))
    with deepspeed.zero.GatheredParameters(model.leaf.weight):
        loss = Project.apply(h, model.leaf.weight).square().mean()
    with pytest.raises(RuntimeError) as failure:
        loss.backward()
    return str(failure.value)


def test_gradient_for_a_released_leaf_parameter_names_it_and_the_remedy() -> None:
    """Gathering there could differ by rank (a leaf's unit): a clear error on every rank, not a
    shape error."""
    for message in run_distributed(2, leaf_gradient_refused):
        assert "gradient arrived for parameter 'leaf.weight' while it is released" in message, message
        assert "z3 leaf module" in message and "register_external_parameter" in message, message
