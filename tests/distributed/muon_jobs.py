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
               skip: int = 0) -> dict:
    """Train `steps` global steps (after skipping `skip` batches); full params after each step."""
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = deepspeed.initialize(model=make_net(), config=copy.deepcopy(config))
    if load is not None:
        engine.load_checkpoint(load)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    history, wire = [], []
    for step, (x, y) in enumerate(batches(skip + steps)):
        if step < skip:
            continue
        dist.comms_counter.reset()
        for k in range(gas):
            start = (k * world + rank) * micro
            engine.backward(engine(x[start:start + micro], y[start:start + micro]))
            engine.step()
        # Muon's two exchanges are the only all-to-alls of a training step: bytes this rank sent
        wire.append(dist.comms_counter.summary().get("all_to_all_single", {}).get("bytes", 0))
        history.append(full_params(engine))
    if save is not None:
        engine.save_checkpoint(save, tag="t")
    tags = {n: bool(p.use_muon) for n, p in engine.module.named_parameters()}
    return {"history": history if rank == 0 else None, "momentum_bytes": state_bytes(engine, "momentum_buffer"),
            "state_bytes": state_bytes(engine), "wire": wire,
            "tags": tags}


def reference(steps: int, lr: float = 3e-3, muon_lr: float = 0.02, momentum: float = 0.9, wd: float = 0.1) -> list:
    """torch.optim.Muon on the hidden matrices + torch.optim.AdamW on the rest, one process,
    the whole global batch: full params after each step."""
    model = make_net()
    muon = [model.up.weight, model.down.weight]
    adam = [p for p in model.parameters() if all(p is not q for q in muon)]
    optimizers = [torch.optim.Muon(muon, lr=muon_lr, momentum=momentum, weight_decay=wd),
                  torch.optim.AdamW(adam, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)]
    history = []
    for x, y in batches(steps):
        model.zero_grad()
        model(x, y).backward()
        for opt in optimizers:
            opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history
