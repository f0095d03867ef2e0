"""Models, data and the plain-PyTorch reference for the ZeRO stage 1/2 case tests (test_zero_cases.py).

Every model takes `(x, y)` with x float [B, 16] and y int labels in [0, 4), and returns the mean
cross-entropy, so one data generator and one reference loop serve them all. The reference trains
on the whole global batch; with equal micro-batches its mean loss equals the average of the
micro-batch losses the engine averages over ranks and accumulation steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from models import TinyMLP, global_batches, micro_slice  # noqa: F401  (re-exported for the tests)


class OddNet(nn.Module):
    """Sizes that divide by neither 2 nor 4, a zero-sized parameter used in forward (it gets an
    empty gradient) and one never used (it gets none)."""

    def __init__(self) -> None:
        super().__init__()
        # Direct parameters come first in parameters(), so last in gradient (reduction) order.
        self.empty = nn.Parameter(torch.empty(0))
        self.empty_unused = nn.Parameter(torch.empty(0))
        self.fc1 = nn.Linear(15, 7)       # 105 + 7
        self.fc2 = nn.Linear(7, 5)        # 35 + 5
        self.gate = nn.Module()
        self.gate.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.head = nn.Linear(5, 4)       # 20 + 4

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x[:, :15]))))
        h = torch.cat([h[:, :3] * self.gate.scale, h[:, 3:]], dim=1)
        out = self.head(h) + self.empty.sum()
        return F.cross_entropy(out, y)


class TiedNet(nn.Module):
    """The embedding matrix is also the output head's weight (one nn.Parameter, two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 8)
        self.proj = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens = torch.argmax(x[:, :4], dim=1)
        h = torch.tanh(self.proj(x) + self.emb(tokens))
        return F.cross_entropy(self.head(h), y)


class ManySmall(nn.Module):
    """40 small tensors (20 Linear(4, 4)): collectives must follow buckets, not tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(20))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x[:, :4]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.cross_entropy(h * 3.0, y)


class AutocastNet(nn.Module):
    """Linear (lower-precision safe under torch_autocast) around a LayerNorm (not safe)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(self.norm(torch.relu(self.fc(x))))
        return F.cross_entropy(out.float(), y)


class RankBranch(TinyMLP):
    """`extra` takes part only when `use_extra` is set: the driver sets it per rank and step."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(32, 4)
        self.use_extra = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(h)
        if self.use_extra:
            out = out + self.extra(h)
        return F.cross_entropy(out, y)


MODELS = {"mlp": TinyMLP, "odd": OddNet, "tied": TiedNet, "many": ManySmall, "autocast": AutocastNet,
          "branch": RankBranch}


def build(name: str, seed: int = 0, frozen: tuple[str, ...] = ()) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    for pname, p in model.named_parameters():
        if pname in frozen:
            p.requires_grad_(False)
    return model


def param_groups(model: nn.Module, spec: list[dict]) -> list[dict]:
    """Param-group dicts from `spec`: each entry's "names" (exact parameter names) plus its options.
    Trainable parameters no entry names go into a last group with the optimizer's defaults."""
    named = dict(model.named_parameters())
    taken: set[str] = set()
    groups = []
    for entry in spec:
        options = {k: v for k, v in entry.items() if k != "names"}
        groups.append({"params": [named[n] for n in entry["names"]], **options})
        taken.update(entry["names"])
    rest = [p for n, p in named.items() if n not in taken and p.requires_grad]
    if rest:
        groups.append({"params": rest})
    return groups


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def reference(name: str, config: dict, steps: int, world: int, groups: list[dict] | None = None,
              frozen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Plain PyTorch on the whole global batch, same optimizer, groups, freezing and clipping."""
    micro = config["train_micro_batch_size_per_gpu"]
    gas = config.get("gradient_accumulation_steps", 1)
    clip = config.get("gradient_clipping", 0.0)
    model = build(name, frozen=frozen)
    opt_cfg = config["optimizer"]
    hp = dict(opt_cfg["params"])
    params = param_groups(model, groups) if groups else [p for p in model.parameters() if p.requires_grad]
    if opt_cfg["type"].lower() == "adamw":
        opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"],
                                betas=tuple(hp.get("betas", (0.9, 0.999))), eps=hp.get("eps", 1e-8))
    else:
        opt = torch.optim.SGD(params, lr=hp["lr"], momentum=hp.get("momentum", 0.0))
    losses = []
    for x, y in global_batches(steps, micro * gas * world):
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": state_of(model)}
