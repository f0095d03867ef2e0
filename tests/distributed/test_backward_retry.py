"""A backward that raises (here: in an activation checkpoint's recompute) must leave the engine
ready for the next one, at every ZeRO stage, whether it came through engine.backward or a direct
loss.backward(). Without zero_grad() the failed backward's partial gradients stay accumulated, as in
plain PyTorch (checked against it); with zero_grad() the run equals one that never failed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fail_recompute = False
        self._calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        if self.fail_recompute and self._calls % 2 == 0:   # the second call of a step is the recompute
            self.fail_recompute = False
            raise RuntimeError("injected checkpoint recompute failure")
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(8, 16), Block(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=False)
        return nn.functional.cross_entropy(self.head(h), y)


def _batches(rank: int) -> tuple[tuple, list]:
    g = torch.Generator().manual_seed(1 + rank)
    failing = (torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g))
    return failing, [(torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g)) for _ in range(3)]


def train(stage: int, fail: str, zero_grad: bool = True) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    torch.manual_seed(0)
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    failing, batches = _batches(dist.get_rank())
    raised = None
    if fail != "none":
        model.block.fail_recompute = True
        model.block._calls = 0
        loss = engine(*failing)
        try:
            engine.backward(loss) if fail == "engine" else loss.backward()
        except RuntimeError as e:
            raised = str(e)
        if zero_grad:
            engine.zero_grad()   # drop what the failed backward accumulated
    losses = []
    for x, y in batches:
        model.block._calls = 0
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if stage == 3:
        released = all(p.numel() == 0 for p in model.parameters())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        released, state = True, {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"raised": raised, "losses": losses, "state": state, "released": released}


def both(stage: int, fail: str) -> dict:
    return {"clean": train(stage, "none"), "retried": train(stage, fail)}


def plain_pytorch_keeping_partial_gradients(world: int) -> dict:
    """Data parallelism by hand: each rank's gradients summed then divided by `world`; the failed
    backward's partial gradients (the head's: backward reached it before the recompute) are kept."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    data = [_batches(rank) for rank in range(world)]
    for failing, _ in data:
        model.block.fail_recompute, model.block._calls = True, 0
        with pytest.raises(RuntimeError, match="injected"):
            model(*failing).backward()
    for step in range(3):
        for _, batches in data:
            model.block._calls = 0
            model(*batches[step]).backward()
        for p in model.parameters():
            p.grad /= world
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def retry_without_zero_grad(stage: int, fail: str) -> dict:
    return train(stage, fail, zero_grad=False)


@pytest.mark.parametrize("stage,fail", [(1, "engine"), (2, "direct"), (3, "engine"), (3, "direct")])
def test_retry_without_zero_grad_keeps_partial_gradients_like_pytorch(stage: int, fail: str) -> None:
    expected = plain_pytorch_keeping_partial_gradients(2)
    for r in run_distributed(2, retry_without_zero_grad, stage, fail):
        assert r["raised"] is not None and r["released"]
        for name, value in expected.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage,fail", [(0, "engine"), (1, "direct"), (2, "engine"), (3, "engine"), (3, "direct")])
def test_retry_after_a_failed_recompute_trains_like_a_clean_run(stage: int, fail: str) -> None:
    for r in run_distributed(2, both, stage, fail):
        clean, retried = r["clean"], r["retried"]
        assert retried["raised"] is not None and "injected checkpoint recompute failure" in retried["raised"]
        assert retried["released"]
        assert retried["losses"] == pytest.approx(clean["losses"], rel=1e-6)
        for name, value in clean["state"].items():
            torch.testing.assert_close(retried["state"][name], value, rtol=1e-6, atol=1e-7, msg=name)
