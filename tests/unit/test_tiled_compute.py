"""ALST tiled compute (single process): TiledMLP, sequence_tiled_compute, TiledFusedLogitsLoss and
TiledLoss give plain PyTorch's values and gradients (fp32 to ~1e-6: the shards' matmuls sum the
parameter gradient over tokens in another grouping, so not bit-equal), uneven and oversized shard
counts, bf16 tracking fp32, and the activation bytes the tiling saves, counted with saved-tensor hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepspeed.runtime.sequence_parallel.tiled_compute import (AutogradComputeMLP, SequenceTiledCompute,
                                                                TiledFusedLogitsLoss, TiledLoss, TiledMLP,
                                                                sequence_tiled_compute)

H, VOCAB = 16, 40


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(H, 4 * H)
        self.down_proj = nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


def _grads(module: nn.Module, x: torch.Tensor, run) -> tuple:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = run(module, x)
    (out.float() ** 2).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def _assert_same(a: tuple, b: tuple, **tol) -> None:
    for u, v in zip(a[:2] + tuple(a[2]), b[:2] + tuple(b[2])):
        torch.testing.assert_close(u, v, **tol)


def _tiled(shards: int):
    return lambda m, x: TiledMLP.apply(MLP.forward, m, x, shards, list(m.parameters()))


@pytest.mark.parametrize("shape,shards", [((1, 13, H), 4), ((2, 13, H), 3), ((13, H), 5), ((2, 3, H), 10)])
def test_tiled_mlp_matches_plain(shape, shards) -> None:
    """Uneven last shard, bs > 1, MoE-style [tokens, hidden], more shards than tokens (one token each)."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(shape)
    _assert_same(_grads(m, x, MLP.forward), _grads(m, x, _tiled(shards)), rtol=1e-5, atol=1e-6)


def test_one_shard_is_bit_equal() -> None:
    """One shard runs the same kernels on the same shapes in the same order as plain PyTorch."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(2, 7, H)
    _assert_same(_grads(m, x, MLP.forward), _grads(m, x, _tiled(1)), rtol=0, atol=0)


def test_autograd_compute_mlp_is_bit_equal() -> None:
    """The whole-input recompute runs the same kernels on the same shapes as plain PyTorch."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(2, 7, H)
    _assert_same(_grads(m, x, MLP.forward), _grads(m, x, lambda m, x: AutogradComputeMLP.apply(MLP.forward, m, x)),
                 rtol=0, atol=0)


def test_tiled_mlp_bf16_tracks_fp32() -> None:
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(2, 33, H)
    ref = _grads(m, x, MLP.forward)
    bf = _grads(m.to(torch.bfloat16), x.to(torch.bfloat16), _tiled(4))
    torch.testing.assert_close(bf[1].float(), ref[1], rtol=3e-2, atol=3e-2)
    for g, r in zip(bf[2], ref[2]):
        torch.testing.assert_close(g.float(), r, rtol=3e-2, atol=5e-2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_shards_refused(bad) -> None:
    m = MLP()
    with pytest.raises(ValueError, match="shards="):
        TiledMLP.apply(MLP.forward, m, torch.randn(1, 4, H), bad, list(m.parameters()))


def _stc(reduction, dim=1, shards=4):
    def run(m, x):
        return sequence_tiled_compute(MLP.forward, x.shape[1], shards, dict(x=x), dict(self=m), "x",
                                      list(m.parameters()), output_unshard_dimension=dim, output_reduction=reduction)
    return run


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_matches_plain(reduction) -> None:
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(2, 13, H)
    plain = {None: MLP.forward, "mean": lambda m, x: MLP.forward(m, x).mean(),
             "sum": lambda m, x: MLP.forward(m, x).sum()}[reduction]
    _assert_same(_grads(m, x, plain), _grads(m, x, _stc(reduction)), rtol=1e-5, atol=1e-6)


def test_sequence_tiled_compute_scalar_per_shard() -> None:
    """output_unshard_dimension=0: each slice returns a scalar (a loss); the mean is over slices."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(1, 12, H)

    def per_slice(self, x):
        return MLP.forward(self, x).pow(2).mean()

    def tiled(m, x):
        return sequence_tiled_compute(per_slice, 12, 3, dict(x=x), dict(self=m), "x", list(m.parameters()),
                                      output_unshard_dimension=0, output_reduction="mean")

    def plain(m, x):
        return torch.stack([per_slice(m, x[:, i:i + 4]) for i in range(0, 12, 4)]).mean()

    _assert_same(_grads(m, x, plain), _grads(m, x, tiled), rtol=1e-5, atol=1e-6)


def test_sequence_tiled_compute_bad_args() -> None:
    m, x = MLP(), torch.randn(1, 8, H)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='y'"):
        sequence_tiled_compute(MLP.forward, 8, 2, dict(x=x), dict(self=m), "y")
    with pytest.raises(ValueError, match="output_reduction='max'"):
        _stc("max")(m, x)
    with pytest.raises(ValueError, match=r"seqlen=9"):
        sequence_tiled_compute(MLP.forward, 9, 2, dict(x=x), dict(self=m), "x")
    assert SequenceTiledCompute.apply is not None


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(H, VOCAB, bias=False)


def _loss_fn(reduction):
    def fn(self, x, y, mask=None):
        logits = self.lm_head(x).float()
        if mask is not None:
            y = y.masked_fill(~mask.bool(), -100)
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction=reduction, ignore_index=-100)
    return fn


@pytest.mark.parametrize("with_mask", [False, True])
def test_tiled_fused_logits_loss(with_mask) -> None:
    """"sum" of per-slice sums is the plain sum; "mean" is the plain mean of the per-slice means."""
    torch.manual_seed(0)
    head, x, y = Head(), torch.randn(2, 11, H), torch.randint(0, VOCAB, (2, 11))
    mask = (torch.rand(2, 11) > 0.3).long() if with_mask else None
    flat = (x.view(-1, H), y.view(-1), None if mask is None else mask.view(-1))
    # (with a mask, a 1-token slice's mean can be nan: "sum" only)
    cases = [("sum", 3), ("sum", 50)] if with_mask else [("sum", 3), ("mean", 3), ("mean", 50)]
    for reduction, shards in cases:
        fn = _loss_fn("sum" if reduction == "sum" else "mean")
        bounds = [(s, min(s + -(-22 // min(shards, 22)), 22)) for s in range(0, 22, -(-22 // min(shards, 22)))]

        def plain(m, x, fn=fn, bounds=bounds, reduction=reduction):
            xf = x.view(-1, H)
            parts = [fn(m, xf[a:b], flat[1][a:b], *(() if mask is None else (flat[2][a:b], ))) for a, b in bounds]
            return torch.stack(parts).sum() if reduction == "sum" else torch.stack(parts).mean()

        def tiled(m, x, fn=fn, reduction=reduction, shards=shards):
            return TiledFusedLogitsLoss.apply(fn, m, x, y, mask, shards, [m.lm_head.weight], reduction)

        _assert_same(_grads(head, x, plain), _grads(head, x, tiled), rtol=1e-5, atol=1e-6)


def test_tiled_fused_logits_loss_errors() -> None:
    head, x, y = Head(), torch.randn(2, 6, H), torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="output_reduction=None"):
        TiledFusedLogitsLoss.apply(_loss_fn("mean"), head, x, y, None, 2, [], None)
    with pytest.raises(ValueError, match="differ in their batch/seq"):
        TiledFusedLogitsLoss.apply(_loss_fn("mean"), head, x, y[:, :5], None, 2, [], "mean")
    with pytest.raises(ValueError, match="mask"):
        TiledFusedLogitsLoss.apply(_loss_fn("mean"), head, x, y, torch.ones(2, 5), 2, [], "mean")


def _hf_loss(logits, labels, vocab_size, shift_labels):
    return F.cross_entropy(logits.float().view(-1, vocab_size), shift_labels.view(-1), ignore_index=-100)


def test_tiled_loss_is_token_weighted_mean() -> None:
    """-100 labels spread unevenly (one slice has none counted): the mean over every counted token."""
    torch.manual_seed(0)
    logits = torch.randn(1, 12, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 12))
    labels[0, :4] = -100
    labels[0, 5] = -100
    plain = _hf_loss(logits, None, VOCAB, labels)
    (g_plain, ) = torch.autograd.grad(plain, logits)
    tiled = TiledLoss.apply(_hf_loss, logits, VOCAB, labels, 3)
    (g_tiled, ) = torch.autograd.grad(tiled, logits)
    torch.testing.assert_close(tiled, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_tiled, g_plain, rtol=1e-5, atol=1e-7)


class _SavedBytes:
    """Bytes autograd keeps for backward, split by the tensors' last dim (counted at pack time)."""

    def __init__(self) -> None:
        self.by_width: dict[int, int] = {}
        self.max_by_width: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        w = t.shape[-1] if t.dim() else 0
        n = t.numel() * t.element_size()
        self.by_width[w] = self.by_width.get(w, 0) + n
        self.max_by_width[w] = max(self.max_by_width.get(w, 0), n)
        return t


def _count(run) -> _SavedBytes:
    c = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
        run()
    return c


def test_tiled_mlp_activation_memory() -> None:
    """The 4H-wide intermediate: untiled keeps all tokens' from forward to backward; tiled keeps none
    after forward and at most one shard's (ceil(T/n) tokens) while recomputing in backward."""
    torch.manual_seed(0)
    m, x, n, tokens = MLP(), torch.randn(2, 64, H, requires_grad=True), 8, 128
    wide = 4 * H * 4   # bytes per token of the intermediate
    untiled = _count(lambda: MLP.forward(m, x))
    assert untiled.max_by_width[4 * H] == tokens * wide
    out = {}
    tiled_fwd = _count(lambda: out.setdefault("y", TiledMLP.apply(MLP.forward, m, x, n, list(m.parameters()))))
    assert 4 * H not in tiled_fwd.by_width   # forward keeps x only
    assert tiled_fwd.by_width[H] == x.numel() * 4
    tiled_bwd = _count(lambda: out["y"].sum().backward())
    assert tiled_bwd.max_by_width[4 * H] == tokens // n * wide   # 1/n of untiled's


def test_tiled_fused_loss_logits_memory() -> None:
    """The largest logits tensor kept for backward is one shard's, not all tokens' (1/n)."""
    torch.manual_seed(0)
    head, x, y, n = Head(), torch.randn(1, 64, H, requires_grad=True), torch.randint(0, VOCAB, (1, 64)), 4
    untiled = _count(lambda: _loss_fn("mean")(head, x, y).backward())
    tiled = _count(lambda: TiledFusedLogitsLoss.apply(_loss_fn("mean"), head, x, y, None, n,
                                                      [head.lm_head.weight], "mean").backward())
    assert untiled.max_by_width[VOCAB] == 64 * VOCAB * 4
    assert tiled.max_by_width[VOCAB] == 64 // n * VOCAB * 4
