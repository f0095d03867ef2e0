"""Models, data and the plain-PyTorch reference for the ZeRO-3 parity matrix (test_zero3_parity.py).

Every model takes `(x, y)` and returns a mean cross-entropy. `build(name)` makes the same
initial model in every process; `batches(name, ...)` the same global batches. A global batch
is laid out as `micro_slice` reads it: micro step k of rank r at rows (k * world + r) * micro.
The reference runs one forward per micro step on the concatenation of all ranks' micro batches
(micro steps in the same order as the engine, so models whose control flow depends on the
micro step take the same path) and divides each loss by gas, which is what the engine's
mean over ranks and division by gradient_accumulation_steps amount to with equal micro batches.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from models import global_batches
from models_zero import TiedNet

_GPT_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt", "model.py")


def _gpt_module() -> Any:
    """examples/gpt/model.py under a unique module name (`model` is too generic to import)."""
    name = "examples_gpt_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.abspath(_GPT_FILE))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


GPT_VOCAB, GPT_BLOCK = 64, 16


def tiny_gpt() -> nn.Module:
    """The example GPT (LM head tied to the token embedding), 2 layers of width 32, no biases:
    the attention's key bias has an exactly-zero gradient, pure rounding noise (see the test's
    [Note: SGD for the deeper models])."""
    gpt = _gpt_module()
    config = gpt.GPTConfig(vocab_size=GPT_VOCAB, block_size=GPT_BLOCK, n_layer=2, n_head=2, n_embd=32, bias=False)
    return gpt.GPT(config)


class BranchNet(nn.Module):
    """`extra` runs on the forward calls listed in TAKEN only: the same on every rank, but some
    global steps use it on some micro steps, others not at all (it then gets a zero gradient)."""

    TAKEN = frozenset({1, 6, 7, 13})   # with gas 4: steps 0, 1, 3 partly, steps 2 and 4 never

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.extra = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.calls = 0
        self.taken: list[bool] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        take = self.calls in self.TAKEN
        self.calls += 1
        self.taken.append(take)
        if take:
            h = h + torch.tanh(self.extra(h))
        return F.cross_entropy(self.head(h), y)


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(h)))


class ToyMoE(nn.Module):
    """Top-1 mixture of experts: each token goes to the argmax of the router's logits, scaled by
    its gate probability (so the router is trained). Experts without tokens do not run: which
    submodules run depends on the data, so under ZeRO-3 this must be a leaf module.
    The router starts with a strong preference of expert e for input feature e (ROUTE_PRIOR),
    so the data decides the routing (see `moe_batches`) and a few steps do not change it."""

    EXPERTS, ROUTE_PRIOR = 4, 3.0

    def __init__(self, dim: int = 16, hidden: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(dim, self.EXPERTS)
        with torch.no_grad():
            self.router.weight[:, :self.EXPERTS] += self.ROUTE_PRIOR * torch.eye(self.EXPERTS)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(self.EXPERTS))
        self.usage: list[list[int]] = []   # tokens per expert, one row per forward

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), dim=-1)
        top = probs.argmax(dim=-1)
        self.usage.append(torch.bincount(top, minlength=self.EXPERTS).tolist())
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * probs[rows, e:e + 1])
        return out


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = ToyMoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class MoENet(nn.Module):
    """inp -> block.moe (leaf) -> head. `inp` starts near the identity so the routing features
    reach the router; its unit's gradient is complete after the MoE's in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        with torch.no_grad():
            self.inp.weight.mul_(0.1).add_(torch.eye(16))
        self.block = MoEBlock()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.block(self.inp(x)))), y)


class MLPBlock(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


def _reentrant(fn: Any, *args: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint(fn, *args, use_reentrant=True)


def _deepspeed_checkpoint(fn: Any, *args: torch.Tensor) -> torch.Tensor:
    import deepspeed.checkpointing   # upstream's API; skipped by the test where our package lacks it

    return deepspeed.checkpointing.checkpoint(fn, *args)


CHECKPOINT_FNS = {"torch": _reentrant, "deepspeed": _deepspeed_checkpoint}


class CheckpointedNet(nn.Module):
    """inp -> 2 residual MLP blocks -> head, blocks under reentrant activation checkpointing.
    `everything`: inp and head are checkpointed too, so every parameter's gradient is computed
    inside a nested backward (the recomputation) and the raw input is the first segment's input:
    it must require grad, or reentrant checkpointing gives inp no gradient (what Hugging Face's
    `enable_input_require_grads` does for its embeddings)."""

    def __init__(self, fn: str = "torch", everything: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(2))
        self.head = nn.Linear(32, 4)
        self.fn, self.everything = fn, everything

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ckpt = CHECKPOINT_FNS[self.fn]
        if self.everything:
            h = ckpt(self.inp, x.detach().requires_grad_())
        else:
            h = self.inp(x)
        for block in self.blocks:
            h = ckpt(block, h)
        logits = ckpt(self.head, h) if self.everything else self.head(h)
        return F.cross_entropy(logits, y)


class OddNet(nn.Module):
    """Parameters whose sizes no world size of 2 or 4 divides (55, 112, 7, 91, 13, 65, 13, 13,
    52, 4 and 3 elements; 3 < 4, so at world 4 one rank's piece of `temp` is all padding), in
    units of one, two and three parameters: every per-parameter padding case of the shards."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.inp = nn.Linear(16, 7)
        self.mid = nn.Linear(7, 13)
        self.mix = nn.Linear(5, 13, bias=False)
        self.norm = nn.LayerNorm(13)
        self.head = nn.Linear(13, 4)
        self.temp = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        idx = (x[:, 0].abs() * 4).long() % 11
        h = self.norm(self.mid(torch.tanh(self.inp(x))) + self.mix(self.emb(idx)))
        logits = self.head(torch.relu(h)) * torch.cat([self.temp, self.temp.new_ones(1)])
        return F.cross_entropy(logits, y)


MODELS = {"gpt": tiny_gpt, "tied": TiedNet, "branch": BranchNet, "moe": MoENet, "ckpt": CheckpointedNet,
          "odd": OddNet}


def build(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](**kwargs)


def moe_batches(steps: int, micro: int, gas: int, world: int, experts: tuple[tuple[int, ...], ...],
                seed: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random features plus a large bump on feature e for the expert e chosen for the token:
    rank r's tokens cycle through experts[r], so the routing per rank is set by the data."""
    for x, y in global_batches(steps, micro * gas * world, seed=seed):
        for k in range(gas):
            for r in range(world):
                for j in range(micro):
                    x[(k * world + r) * micro + j, experts[r][j % len(experts[r])]] += 8.0
        yield x, y


def batches(name: str, steps: int, micro: int, gas: int, world: int,
            **data: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of model `name` (the same in every process)."""
    if name == "gpt":
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            idx = torch.randint(0, GPT_VOCAB, (micro * gas * world, GPT_BLOCK + 1), generator=g)
            yield idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    elif name == "moe":
        yield from moe_batches(steps, micro, gas, world, **data)
    else:
        yield from global_batches(steps, micro * gas * world)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def reference(name: str, config: dict, steps: int, world: int, model_kwargs: dict | None = None,
              data: dict | None = None) -> dict[str, Any]:
    """Plain PyTorch, one process, AdamW or SGD as configured. A trainable parameter that got no
    gradient in a step gets a zero one: DeepSpeed steps every trainable parameter each step
    (upstream's engine and ZeRO fill missing gradients with zeros), so AdamW's weight decay and
    moment decay apply to it, where torch.optim would skip a parameter whose grad is None."""
    micro = config["train_micro_batch_size_per_gpu"]
    gas = config.get("gradient_accumulation_steps", 1)
    model = build(name, **(model_kwargs or {}))
    initial = state_of(model)
    hp = config["optimizer"]["params"]
    if config["optimizer"]["type"] == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"],
                                eps=hp.get("eps", 1e-8))
    losses = []
    for x, y in batches(name, steps, micro, gas, world, **(data or {})):
        total = 0.0
        for k in range(gas):
            rows = slice(k * world * micro, (k + 1) * world * micro)   # micro step k of every rank
            loss = model(x[rows], y[rows])
            (loss / gas).backward()
            total += loss.item()
        for p in model.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return {"losses": losses, "state": state_of(model), "initial": initial, "model": model}
