"""TiledMLP and TiledFusedLogitsLoss under the engine at 2 ranks (ZeRO 1, 2 and 3): the averaged gradients
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

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self._mlp(self.mlp2, self._mlp(self.mlp1, x))
        if y is None:   # hidden states: the caller computes the loss outside the engine's forward
            return h
        return self.loss(h, y)

    def loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.tiled:
            return self._loss(self, h, y) / y.numel()
        from deepspeed.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss
        return TiledFusedLogitsLoss.apply(Model._loss, self, h, y, None, SHARDS, [self.lm_head.weight],
                                          "sum") / y.numel()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(1, SEQLENS[rank], H, generator=g), torch.randint(0, VOCAB, (1, SEQLENS[rank]), generator=g)


def _job(stage: int, outside: bool = False) -> dict:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Model(tiled=False)
    model = Model(tiled=True)
    model.load_state_dict(plain.state_dict())
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = _data(rank)
    x = x.requires_grad_(True)
    # outside: the tiled loss is the first node of the backward, outside every module's forward (TRL's
    # fused LM-head loss): its nested backwards must not start (and end) ZeRO-3's backward
    loss = engine.module.loss(engine(x), y) if outside else engine(x, y)
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


@pytest.mark.parametrize("stage,outside", [(1, False), (2, False), (3, False), (3, True)])
def test_tiled_compute_zero_two_ranks(stage: int, outside: bool) -> None:
    assert run_distributed(2, _job, stage, outside) == [{"ok": True}, {"ok": True}]


# --- UlyssesSPFwdLossBwdWithLogits ---------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402


@dataclass
class _Out:
    logits: torch.Tensor


class TokenLM(nn.Module):
    """Token-wise (no attention), so a sequence slice's logits are the full sequence's: the SP loss must
    equal the full-sequence loss exactly. Hugging Face's surface: `.config.vocab_size`, `loss_function`."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": VOCAB})()
        self.embed = nn.Embedding(VOCAB, H)
        self.mlp = MLP()
        self.lm_head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False) -> _Out:
        return _Out(self.lm_head(self.mlp(self.embed(input_ids))))

    @staticmethod
    def loss_function(logits, labels, vocab_size, shift_labels):
        return F.cross_entropy(logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=-100)


def _sp_batch(rank: int) -> dict:
    n = (8, 12)[rank]   # different lengths on the two ranks
    g = torch.Generator().manual_seed(7 + rank)
    labels = torch.randint(0, VOCAB, (1, n), generator=g)
    labels[0, [1, n // 2, n // 2 + 1]] = -100   # ignored tokens on and beside the slice edge
    return {"input_ids": torch.randint(0, VOCAB, (1, n), generator=g), "position_ids": torch.arange(n)[None],
            "labels": labels}


def _sp_job(stage: int, shards) -> dict:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.tiled_compute import UlyssesSPFwdLossBwdWithLogits
    from deepspeed.utils import safe_get_full_grad
    torch.manual_seed(0)
    plain, model = TokenLM(), TokenLM()
    model.load_state_dict(plain.state_dict())
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    driver = UlyssesSPFwdLossBwdWithLogits(engine, model, torch.device("cpu"), num_loss_logit_shards=shards)
    loss = driver.sp_fwd_loss_bwd(_sp_batch(dist.get_rank()))
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    ref = []
    for r in range(2):   # the full sequences, one after the other, gradients accumulated
        b = _sp_batch(r)
        shift = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]
        full = TokenLM.loss_function(plain(b["input_ids"], b["position_ids"]).logits, None, VOCAB, shift)
        full.backward()
        ref.append(full.item())
    torch.testing.assert_close(loss, sum(ref) / 2, rtol=1e-6, atol=1e-6)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    return {"ok": True}


@pytest.mark.parametrize("stage,shards", [(2, 2), (3, 1)])
def test_ulysses_fwd_loss_bwd_equals_full_sequence(stage: int, shards) -> None:
    assert run_distributed(2, _sp_job, stage, shards) == [{"ok": True}, {"ok": True}]
