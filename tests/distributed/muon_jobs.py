"""Muon under ZeRO: the model, data, per-rank training job and the torch.optim reference.

The model has every kind of parameter the `use_muon` rule sorts: an embedding and an `lm_head`
(AdamW by name), two hidden matrices of odd shapes, one wide and one tall (Muon), biases and a
LayerNorm (AdamW, 1-D). Every run sees the same global batch of 8 per step, however it is split
over ranks and accumulation steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

GLOBAL_BATCH, VOCAB, SEQ = 8, 11, 3


class MuonNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 9)
        self.up = nn.Linear(9, 21)          # 21 x 9: tall
        self.norm = nn.LayerNorm(21)
        self.down = nn.Linear(21, 13)       # 13 x 21: wide
        self.lm_head = nn.Linear(13, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        h = torch.tanh(self.down(self.norm(torch.relu(self.up(h)))))
        return F.cross_entropy(self.lm_head(h), y)


def make_net() -> MuonNet:
    torch.manual_seed(0)
    return MuonNet()


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
               torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g))


def muon_config(stage: int, gas: int, world: int, **params: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (gas * world),
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Muon", "params": {"lr": 3e-3, "muon_lr": 0.02, "momentum": 0.9, "weight_decay": 0.1,
                                                  "betas": [0.9, 0.95], "eps": 1e-8, **params}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0},
    }


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 value (collective at stage 3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def state_bytes(engine: Any, field: str | None = None) -> int:
    """Bytes of per-element optimizer state (`field`'s, or all) this rank's base optimizer holds."""
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    return sum(t.numel() * t.element_size() for s in base.state.values() for k, t in s.items()
               if torch.is_tensor(t) and t.dim() > 0 and field in (None, k))


def muon_train(config: dict, steps: int, save: str | None = None, load: str | None = None,
               skip: int = 0, loss_mult: float = 1.0) -> dict:
    """Train `steps` global steps (after skipping `skip` batches) on the loss times `loss_mult`;
    full params and the engine's reported gradient norm after each step."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = deepspeed.initialize(model=make_net(), config=copy.deepcopy(config))
    if load is not None:
        engine.load_checkpoint(load)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    history, wire, norms = [], [], []
    for step, (x, y) in enumerate(batches(skip + steps)):
        if step < skip:
            continue
        dist.comms_counter.reset()
        for k in range(gas):
            start = (k * world + rank) * micro
            engine.backward(engine(x[start:start + micro], y[start:start + micro]) * loss_mult)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        # Muon's two exchanges are the only all-to-alls of a training step: bytes this rank sent
        wire.append(dist.comms_counter.summary().get("all_to_all_single", {}).get("bytes", 0))
        history.append(full_params(engine))
    if save is not None:
        engine.save_checkpoint(save, tag="t")
    tags = {n: bool(p.use_muon) for n, p in engine.module.named_parameters()}
    return {"history": history if rank == 0 else None, "momentum_bytes": state_bytes(engine, "momentum_buffer"),
            "state_bytes": state_bytes(engine), "wire": wire, "norms": norms,
            "tags": tags}


def reference_steps(history: list, lr: float = 3e-3, muon_lr: float = 0.02, momentum: float = 0.9,
                    wd: float = 0.1, clip: float = 0.0, loss_mult: float = 1.0) -> list:
    """torch.optim.Muon on the hidden matrices + torch.optim.AdamW on the rest, one process, the
    whole global batch, each step taken from the weights `history` (an engine's full params
    after each step) holds before it, gradients clipped as `torch.nn.utils.clip_grad_norm_` does
    when `clip` > 0. Per step: the params after it, the Muon matrices after the same step by the
    formula in fp64 ("exact": Keller Jordan's Muon, which torch's computes in bf16), the raw
    gradient norm and each parameter's raw gradient."""
    model = make_net()
    params = dict(model.named_parameters())
    muon = [model.up.weight, model.down.weight]
    adam = [p for p in model.parameters() if all(p is not q for q in muon)]
    optimizers = [torch.optim.Muon(muon, lr=muon_lr, momentum=momentum, weight_decay=wd),
                  torch.optim.AdamW(adam, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)]
    steps, momenta = [], [torch.zeros_like(p, dtype=torch.float64) for p in muon]
    for step, (x, y) in enumerate(batches(len(history))):
        if step > 0:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(history[step - 1][name])
        model.zero_grad()
        (model(x, y) * loss_mult).backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        exact = {}
        for name, p, m in zip(("up.weight", "down.weight"), muon, momenta):
            g = p.grad.double()
            m.lerp_(g, 1 - momentum)
            update = _newton_schulz_fp64(g.lerp(m, momentum)) * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
            exact[name] = (p.detach().double() * (1 - muon_lr * wd) - muon_lr * update).float()
        for opt in optimizers:
            opt.step()
        steps.append({"params": {n: p.detach().clone() for n, p in params.items()}, "exact": exact,
                      "norm": float(norm), "grads": grads})
    return steps


def _newton_schulz_fp64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Five quintic Newton-Schulz iterations, (a, b, c) = (3.4445, -4.7750, 2.0315), in fp64."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x
