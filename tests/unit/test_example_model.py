"""The GPT example's model and byte-level dataset (examples/gpt): shapes, tying, determinism, learning."""

from __future__ import annotations

import os
import sys

import pytest
import torch

GPT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt")
sys.path.insert(0, os.path.abspath(GPT_DIR))

from data import DEFAULT_CORPUS, TextDataset, decode, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture()
def tiny_model():
    torch.manual_seed(0)
    return GPT(TINY)


def test_forward_shapes_and_backward(tiny_model):
    idx = torch.randint(0, 256, (3, TINY.block_size))
    logits = tiny_model(idx)
    assert logits.shape == (3, TINY.block_size, 256)
    loss = tiny_model(idx, idx)
    assert loss.dim() == 0
    # At init the prediction is near uniform over 256 bytes: loss ~ ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    loss.backward()
    for name, p in tiny_model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_shorter_sequences_and_too_long(tiny_model):
    assert tiny_model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)
    with pytest.raises(ValueError):
        tiny_model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_causal(tiny_model):
    # Changing a later token must not change the logits of earlier positions.
    idx = torch.randint(0, 256, (1, TINY.block_size))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    a, b = tiny_model(idx), tiny_model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_weight_tying(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.tok_emb.weight
    names = [n for n, _ in tiny_model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # counted once
    n = sum(p.numel() for p in tiny_model.parameters())
    assert tiny_model.num_parameters() == n
    # The tied matrix receives gradient from both the embedding lookup and the head.
    tiny_model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))).backward()
    assert tiny_model.tok_emb.weight.grad.abs().sum() > 0


def test_corpus_is_shipped_text():
    data = load_corpus()
    assert data.dtype == torch.uint8
    assert 900_000 < data.numel() <= 1_000_000
    assert os.path.getsize(DEFAULT_CORPUS) == data.numel()
    assert "Elizabeth" in decode(data[:200_000].tolist())


def test_dataset_windows_deterministic():
    ds = TextDataset(block_size=64)
    n = load_corpus().numel()
    assert len(ds) == (n - 65) // 64 + 1
    x, y = ds[3]
    assert x.dtype == torch.long and x.shape == (64,) and y.shape == (64,)
    torch.testing.assert_close(x[1:], y[:-1])  # y is x shifted by one byte
    raw = load_corpus()
    torch.testing.assert_close(x, raw[3 * 64:4 * 64].long())
    # Same index, same window: across calls and across dataset instances.
    again = TextDataset(block_size=64)
    for i in (0, 17, len(ds) - 1, -1):
        torch.testing.assert_close(ds[i][0], again[i][0])
        torch.testing.assert_close(ds[i][1], again[i][1])
    last_x, last_y = ds[len(ds) - 1]
    assert last_y.shape == (64,)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_stride_and_tiny_corpus():
    data = torch.arange(20, dtype=torch.uint8)
    ds = TextDataset(block_size=4, stride=2, data=data)
    assert len(ds) == (20 - 5) // 2 + 1 == 8
    x, y = ds[2]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert ds[7][1].tolist() == [15, 16, 17, 18]  # last window: 14 + 4 + 1 <= 20 bytes
    with pytest.raises(ValueError):
        TextDataset(block_size=32, data=data)


@pytest.fixture()
def one_thread():
    # A single intra-op thread: on a loaded 2-core box, OpenMP workers that spin-wait for a
    # descheduled sibling make this tiny model ~50x slower than running single-threaded.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_loss_decreases_with_adamw(one_thread):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = GPT(cfg)
    ds = TextDataset(block_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        idx = [(step * 16 + j) * 7 % len(ds) for j in range(16)]
        x = torch.stack([ds[i][0] for i in idx])
        y = torch.stack([ds[i][1] for i in idx])
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert losses[0] > 5.0  # ~ln(256) at init
    assert last < first - 1.0, losses  # byte unigram statistics alone are worth ~2 nats
