"""DeepSpeedTransformerLayer inside a ZeRO-3 engine (2 gloo ranks): training matches plain
PyTorch on the whole batch, also with the memory flags on, with the layers built under
zero.Init, and with each layer under torch.utils.checkpoint."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from torch import nn

HIDDEN, HEADS, SEQ, MICRO, STEPS, WORLD = 32, 4, 8, 2, 3, 2


class Encoder(nn.Module):
    def __init__(self, flags: dict, checkpoint: bool) -> None:
        super().__init__()
        import deepspeed

        def config():
            return deepspeed.DeepSpeedTransformerConfig(
                batch_size=MICRO, hidden_size=HIDDEN, heads=HEADS, attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0,
                num_hidden_layers=2, initializer_range=0.1, pre_layer_norm=flags.pop("pre_ln", True), **flags)

        self.layers = nn.ModuleList([deepspeed.DeepSpeedTransformerLayer(config()) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, 1)
        self.checkpoint = checkpoint

    def forward(self, x, mask, y):
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def build(flags: dict, checkpoint: bool) -> Encoder:
    torch.manual_seed(0)
    return Encoder(dict(flags), checkpoint)


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(MICRO * WORLD, SEQ, HIDDEN, generator=g)
        mask = torch.zeros(MICRO * WORLD, 1, 1, SEQ)
        mask[1::2, ..., SEQ - 3:] = torch.finfo(torch.float32).min          # padded rows
        yield x, mask, torch.randn(MICRO * WORLD, SEQ, generator=g)


def _config(stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 0.0, "steps_per_print": 1000}


def train_zero3(flags: dict, checkpoint: bool, zero_init: bool, stage: int = 3) -> dict:
    import deepspeed
    import deepspeed.comm as dist

    rank = dist.get_rank()
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=_config(stage)):
            model = build(flags, checkpoint)
    else:
        model = build(flags, checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage))
    losses = []
    for x, mask, y in batches():
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[rows], mask[rows], y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    state = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            state[name] = p.detach().clone()
    return {"losses": losses, "state": state}


def reference(flags: dict) -> dict:
    model = build(flags, False)
    # SGD, not Adam: Adam's first steps turn rounding-level gradient differences into lr-sized updates.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, mask, y in batches():
        # The engine averages the ranks' mean losses: with equal micro batches, the global mean.
        loss = sum(model(x[r * MICRO:(r + 1) * MICRO], mask[r * MICRO:(r + 1) * MICRO],
                         y[r * MICRO:(r + 1) * MICRO]) for r in range(WORLD)) / WORLD
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("flags,checkpoint,zero_init", [
    ({}, False, False),
    ({"pre_ln": False, "normalize_invertible": True, "gelu_checkpoint": True, "attn_dropout_checkpoint": True},
     False, True),
    ({}, True, False),
], ids=["pre-ln", "post-ln-flags-zero-init", "torch-checkpoint"])
def test_transformer_layer_in_zero3_engine(flags, checkpoint, zero_init):
    results = run_distributed(WORLD, train_zero3, flags, checkpoint, zero_init)
    ref = reference(flags)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert r["state"].keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
