"""TiledMLP and TiledFusedLogitsLoss under the engine at 2 ranks (ZeRO 2 and 3): the averaged gradients
equal plain PyTorch's, with the ranks' sequences of different lengths so their shard counts differ
(the ZeRO-3 gathers and reductions must not depend on them), and the tiled loss first in the backward
(its nested backwards must not end the ZeRO-3 backward early: [Note: tiled backward])."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from harness import run_distributed

H, VOCAB, SHARDS = 8, 24, 4
SEQLENS = (13, 9)   # 4 shards of 4,4,4,1 tokens on rank 0; 3 of 3 on rank 1


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(H, 2 * H, bias=False)
        self.down_proj = nn.Linear(2 * H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


class Model(nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.tiled = tiled
        self.mlp1, self.mlp2 = MLP(), MLP()
        self.lm_head = nn.Linear(H, VOCAB, bias=False)

    def _mlp(self, mlp: MLP, x: torch.Tensor) -> torch.Tensor:
        if not self.tiled:
            return mlp(x)
        from deepspeed.runtime.sequence_parallel.tiled_compute import TiledMLP
        return TiledMLP.apply(MLP.forward, mlp, x, SHARDS, [mlp.up_proj.weight, mlp.down_proj.weight])

    @staticmethod
    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm_head(x).view(-1, VOCAB), y.view(-1), reduction="sum")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self._mlp(self.mlp2, self._mlp(self.mlp1, x))
        if not self.tiled:
            return self._loss(self, h, y) / y.numel()
        from deepspeed.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss
        return TiledFusedLogitsLoss.apply(Model._loss, self, h, y, None, SHARDS, [self.lm_head.weight],
                                          "sum") / y.numel()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(1, SEQLENS[rank], H, generator=g), torch.randint(0, VOCAB, (1, SEQLENS[rank]), generator=g)


def _job(stage: int) -> dict:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Model(tiled=False)
    model = Model(tiled=True)
    model.load_state_dict(plain.state_dict())
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = _data(rank)
    x = x.requires_grad_(True)
    loss = engine(x, y)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    ref_losses = []
    for r in range(world):   # plain PyTorch on every rank's data: the engine averages over ranks
        rx, ry = _data(r)
        rx = rx.requires_grad_(True)
        ref = plain(rx, ry) / world
        ref.backward()
        ref_losses.append(ref.item() * world)
        if r == rank:
            x_ref = rx.grad.clone()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(x.grad, x_ref * world, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.item(), ref_losses[rank], rtol=1e-6, atol=1e-6)
    engine.step()   # the step after a tiled backward works (units released, nothing left held)
    return {"ok": True}


@pytest.mark.parametrize("stage", [2, 3])
def test_tiled_compute_zero_two_ranks(stage: int) -> None:
    assert run_distributed(2, _job, stage) == [{"ok": True}, {"ok": True}]
