"""Small models and data shared by distributed tests (importable in the worker processes)."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, out)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(h)
        if y is None:
            return out
        return nn.functional.cross_entropy(out, y)


class SometimesUnused(TinyMLP):
    """`extra` is used only when the batch's first label is even: ranks can disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(h)
        if int(y[0]) % 2 == 0:
            out = out + self.extra(h)
        return nn.functional.cross_entropy(out, y)


def make_model(seed: int = 0, cls: type = TinyMLP) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def global_batches(steps: int, global_batch: int, dim: int = 16, classes: int = 4, seed: int = 1):
    """The same sequence of global batches on every rank (and in the reference)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(global_batch, dim, generator=g), torch.randint(0, classes, (global_batch,), generator=g)


def micro_slice(x: torch.Tensor, micro: int, gas_index: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s micro-batch number `gas_index` of a global batch."""
    start = (gas_index * world + rank) * micro
    return x[start:start + micro]


def reference_training(config: dict, steps: int, world: int, model_cls: type = TinyMLP,
                       clip: float | None = None, edit=None) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole global batch: the ground truth for engine parity tests.
    `edit(model, step)` runs after every step (as train_engine's, with the model for the engine)."""
    micro = config["train_micro_batch_size_per_gpu"]
    gas = config.get("gradient_accumulation_steps", 1)
    model = make_model(cls=model_cls)
    params = config["optimizer"]["params"]
    opt_type = config["optimizer"]["type"].lower()
    if opt_type == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=params.get("weight_decay", 0.01),
                                betas=tuple(params.get("betas", (0.9, 0.999))), eps=params.get("eps", 1e-8))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params.get("momentum", 0.0))
    losses, first_grads = [], None
    for x, y in global_batches(steps, micro * gas * world):
        loss = model(x, y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if edit is not None:
            edit(model, len(losses) - 1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, first_grads


def assert_params_close(results: list[dict], ref: dict, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    """Every rank's `params` (name -> whole tensor) against the single-process reference's."""
    for rank, result in enumerate(results):
        for name, value in ref["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
