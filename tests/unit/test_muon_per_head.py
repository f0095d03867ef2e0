"""Muon's Newton-Schulz entry points and per-head Muon ([Note: per-head tagging] in
zero/muon/per_head.py): every orthogonalisation goes through upstream's module attributes
`original_muon.zeropower_via_*` (clients wrap them), `num_heads` orthogonalises each head block
alone, and `per_head_muon` tags only projections whose shape confirms a head geometry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import deepspeed.runtime.zero.muon.original_muon as original_muon
from deepspeed.runtime.builder import set_optimizer_flags
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.optimizers import build_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import muon_update
from deepspeed.runtime.zero.muon.per_head import _attention_head_count, resolve_per_head_muon_after_sharding


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls = []
    for name in ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5"):
        kernel = getattr(original_muon, name)
        monkeypatch.setattr(original_muon, name, lambda g, steps, _k=kernel, _n=name: calls.append(_n) or _k(g, steps))
    return calls


@pytest.mark.parametrize("ns_method,kernel", [("gram", "zeropower_via_gram_newtonschulz"),
                                              ("standard", "zeropower_via_newtonschulz5")])
def test_each_muon_matrix_is_orthogonalised_once_through_the_module_attribute(monkeypatch, ns_method, kernel):
    calls = _counting(monkeypatch)
    matrices = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 8))]
    bias = torch.nn.Parameter(torch.randn(6))
    opt = MuonWithAuxAdam([dict(params=matrices, use_muon=True, ns_method=ns_method),
                           dict(params=[bias], use_muon=False)])
    for p in matrices + [bias]:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == [kernel, kernel]


def test_num_heads_orthogonalises_each_head_block_alone():
    torch.manual_seed(0)
    grad, momentum = torch.randn(4 * 8, 32), torch.randn(4 * 8, 32)
    got = muon_update(grad.clone(), momentum.clone(), ns_method="standard", num_heads=4)
    direction = grad.lerp(momentum.lerp(grad, 0.05), 0.95)
    blocks = [original_muon.zeropower_via_newtonschulz5(direction[h * 8:(h + 1) * 8], 5) for h in range(4)]
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got, torch.cat(blocks).float(), rtol=8 * eps, atol=8 * eps)
    full = muon_update(grad.clone(), momentum.clone(), ns_method="newtonschulz5")   # the kernel's name: "standard"
    assert not torch.allclose(got, full, atol=1e-2)
    with pytest.raises(ValueError, match="not divisible by num_heads=5"):
        muon_update(grad.clone(), momentum.clone(), num_heads=5)
    with pytest.raises(ValueError, match="ns_method"):
        muon_update(grad.clone(), momentum.clone(), ns_method="svd")


def test_the_optimizer_step_follows_muon_num_heads():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16, 8))
    b.data.copy_(a.data)
    b.muon_num_heads = 2
    opt = MuonWithAuxAdam([dict(params=[a, b], use_muon=True, ns_method="standard", lr=1.0)])
    a.grad = torch.randn(16, 8)
    a.grad[:8] *= 100
    b.grad = a.grad.clone()
    before = a.detach().clone()
    opt.step()
    whole, per_head = before - a.detach(), before - b.detach()
    assert not torch.allclose(whole[8:], per_head[8:], atol=1e-2)
    assert (per_head[:8].norm() / per_head[8:].norm() - 1).abs() < 0.2   # both heads a comparable update


class _Attention(torch.nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        head_dim = hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden)


def _muon_config(**params) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}}, world_size=1)


def test_per_head_muon_tags_confirmed_projections_and_builds():
    model = _Attention()
    set_optimizer_flags(_muon_config(per_head_muon=True), model)
    heads = {n: p.muon_num_heads for n, p in model.named_parameters()}
    assert heads == {"q_proj.weight": 4, "k_proj.weight": 2, "v_proj.weight": 2, "o_proj.weight": None,
                     "o_proj.bias": None, "mlp.weight": None}
    assert model.k_proj.weight.muon_head_dim == 8
    build_muon({"per_head_muon": True, "lr": 0.01}, list(model.parameters()))   # a Muon key, not a group option
    plain = _Attention()
    set_optimizer_flags(_muon_config(), plain)   # opt-in only
    assert all(p.muon_num_heads is None for p in plain.parameters())


def test_per_head_muon_that_tags_nothing_is_an_error_and_ambiguity_is_left_whole():
    model = _Attention()
    model.config = SimpleNamespace(num_attention_heads=4)   # no width: nothing can confirm
    with pytest.raises(ValueError, match="per_head_muon is enabled but no attention projection could be tagged"):
        set_optimizer_flags(_muon_config(per_head_muon=True), model)
    mla = SimpleNamespace(config=SimpleNamespace(num_attention_heads=8, hidden_size=512, head_dim=96,
                                                 qk_nope_head_dim=64, qk_rope_head_dim=32))
    assert _attention_head_count("l.0.attn.q_proj.weight", torch.zeros(768, 512), mla) == 8   # two routes agree
    assert _attention_head_count("l.0.attn.q_proj.weight", torch.zeros(700, 512), mla) is None
    layer = torch.nn.Module()
    layer.self_attn = _Attention()   # an attention module's own geometry disagrees with the config's: 2 x 16
    layer.self_attn.num_heads, layer.self_attn.head_dim = 2, 16
    layer.config = layer.self_attn.config
    assert _attention_head_count("self_attn.q_proj.weight", layer.self_attn.q_proj.weight, layer) is None
    layer.self_attn.num_heads, layer.self_attn.head_dim = 4, 8
    assert _attention_head_count("self_attn.q_proj.weight", layer.self_attn.q_proj.weight, layer) == 4


def test_head_counts_follow_a_column_parallel_shard():
    model = _Attention()
    set_optimizer_flags(_muon_config(per_head_muon=True), model)
    model.q_proj.weight.data = model.q_proj.weight.data[:16].clone()   # tp=2: 2 of 4 heads
    model.k_proj.weight.data = model.k_proj.weight.data[:12].clone()   # cuts a head of 8
    resolve_per_head_muon_after_sharding(model)
    assert (model.q_proj.weight.muon_num_heads, model.k_proj.weight.muon_num_heads) == (2, None)
    assert model.v_proj.weight.muon_num_heads == 2
    for p in (model.q_proj.weight, model.v_proj.weight):
        p.data = p.data[:12].clone()
    with pytest.raises(ValueError, match="sharded across head boundaries"):
        resolve_per_head_muon_after_sharding(model)
