"""Models and drivers for the backward-equivalence and multi-model tests (importable by workers).

Every variant of `Net` has the same parameters, registered in the same order, so one seed
gives identical initial weights whatever the variant: a checkpointed or fused-loss model can be
compared with the plain model trained by plain PyTorch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

DIM, HIDDEN, CLASSES = 8, 16, 4


class FusedCrossEntropy(torch.autograd.Function):
    """Cross entropy whose gradient is computed in forward, TiledFusedLogitsLoss-style.

    forward detaches the logits, makes them require grad, computes the loss on them and calls
    torch.autograd.backward on that internal sub-graph; backward only scales the stored
    input gradient by the incoming gradient. No parameter takes part in the internal graph.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inner = logits.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = F.cross_entropy(inner, target)
            torch.autograd.backward(loss, torch.ones_like(loss))
        ctx.save_for_backward(inner.grad.detach())
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (logits_grad,) = ctx.saved_tensors
        return logits_grad * grad, None


class FusedHeadLoss(torch.autograd.Function):
    """Head projection + cross entropy fused the way TiledFusedLogitsLoss does it: the head's
    parameter gradients are accumulated by the internal backward in forward (unscaled: only
    exact with gradient_accumulation_steps=1 and no loss scale), the hidden-state gradient is
    kept for backward."""

    @staticmethod
    def forward(ctx: Any, head: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inner = hidden.detach().requires_grad_(hidden.requires_grad)
        with torch.enable_grad():
            loss = F.cross_entropy(head(inner), target)
            torch.autograd.backward(loss)
        ctx.save_for_backward(inner.grad.detach())
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (hidden_grad,) = ctx.saved_tensors
        return None, hidden_grad * grad, None


class Net(nn.Module):
    """fc1 -> mid (Linear + tanh) -> head; cross entropy when a target is given, else logits.

    checkpoint: None, "reentrant" or "nonreentrant" (the middle block); loss: "plain",
    "fused" (FusedCrossEntropy) or "fused_head" (FusedHeadLoss).
    """

    def __init__(self, checkpoint: str | None = None, loss: str = "plain") -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.mid = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.checkpoint_mode = checkpoint
        self.loss_mode = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.checkpoint_mode is None:
            h = self.mid(h)
        else:
            h = checkpoint(self.mid, h, use_reentrant=self.checkpoint_mode == "reentrant")
        if y is not None and self.loss_mode == "fused_head":
            return FusedHeadLoss.apply(self.head, h, y)
        out = self.head(h)
        if y is None:
            return out
        if self.loss_mode == "fused":
            return FusedCrossEntropy.apply(out, y)
        return F.cross_entropy(out, y)


def make_net(seed: int = 0, **variant: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**variant)


def batches(steps: int, global_batch: int, seed: int = 1):
    """The same global batches on every rank and in the references."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(global_batch, DIM, generator=g), torch.randint(0, CLASSES, (global_batch,), generator=g)


def micro_slice(x: torch.Tensor, micro: int, k: int, rank: int, world: int) -> torch.Tensor:
    start = (k * world + rank) * micro
    return x[start:start + micro]


def config(micro: int = 2, gas: int = 1, precision: str = "fp32", **extra: Any) -> dict:
    """SGD with momentum: unlike Adam it is not invariant to a constant gradient factor, so a
    1/gas or loss scale applied twice (or never) changes the parameters."""
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
           "gradient_clipping": 0.0, "steps_per_print": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    cfg.update(copy.deepcopy(extra))
    return cfg


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def reference(cfg: dict, steps: int, world: int, seeds: tuple[int, ...] = (0,),
              weights: tuple[float, ...] = (1.0,)) -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch, fp32, plain Net: every model trained on the whole global batch with one
    backward of the shared loss sum(w_i * loss_i) (a single model when one seed is given)."""
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
    params = cfg["optimizer"]["params"]
    models = [make_net(seed) for seed in seeds]
    opts = [torch.optim.SGD(m.parameters(), lr=params["lr"], momentum=params["momentum"]) for m in models]
    for x, y in batches(steps, micro * gas * world):
        loss = sum(w * m(x, y) for w, m in zip(weights, models))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return [state_of(m) for m in models]


def ce_grad(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d mean-cross-entropy / d logits, analytically, from detached logits (in their dtype)."""
    probs = torch.softmax(logits.detach().float(), dim=-1)
    return ((probs - F.one_hot(y, probs.shape[-1]).float()) / y.numel()).to(logits.dtype)
