"""Model, data, config and a plain-PyTorch reference shared by the tests in tests/gpu."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LR = 1e-3
DIM = 64


class Net(nn.Module):
    """A small MLP with a LayerNorm (kept in the training dtype) and optional dropout."""

    def __init__(self, dropout: float = 0.0, checkpoint: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)   # outside the checkpoints: their input requires grad (reentrant)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Dropout(dropout),
                                                  nn.Linear(2 * DIM, DIM)) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import deepspeed

        x = self.inp(x)
        for block in self.blocks:
            x = x + (deepspeed.checkpointing.checkpoint(block, x) if self.checkpoint else block(x))
        return self.norm(x)


def make_model(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batches(steps: int, device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, DIM, generator=gen).to(device), torch.randn(8, DIM, generator=gen).to(device))
            for _ in range(steps)]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def engine_for(cfg: dict, seed: int = 0, **model_kwargs):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(seed, **model_kwargs), config=cfg)
    return engine


def train(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = loss_of(engine(x.to(torch.bfloat16)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def masters(engine) -> list[torch.Tensor]:
    """Every parameter's fp32 master weight, on the CPU, in parameter order."""
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).detach().float().cpu() for p in engine.module.parameters()]


def reference(data, device: torch.device, seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """Plain PyTorch with the engine's bf16 recipe: bf16 parameters, fp32 master copies stepped by
    AdamW on fp32 gradients, masters cast back to bf16 after each step."""
    model = make_model(seed).to(device, torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=0.01)
    losses = []
    for x, y in data:
        loss = loss_of(model(x.to(torch.bfloat16)), y)
        loss.backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)
        losses.append(loss.item())
    return losses, [m.detach().cpu() for m in master]


def assert_matches_reference(losses, weights, ref_losses, ref_weights) -> None:
    """bf16 forward and backward with the same recipe: the losses agree to bf16's rounding and the
    masters to a small fraction of one AdamW step (lr per element); kernels may differ (fused vs
    foreach AdamW, the flat shard vs separate tensors), so not bit for bit (tests/README.md)."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    for got, want in zip(weights, ref_weights):
        torch.testing.assert_close(got, want, rtol=0, atol=LR / 2)


def training_state(engine) -> dict[str, list[torch.Tensor]]:
    """Masters and Adam moments of every parameter, on the CPU (what a checkpoint must carry)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    state = {"masters": masters(engine)}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = [safe_get_full_optimizer_state(p, key).detach().float().cpu() for p in engine.module.parameters()]
    return state
