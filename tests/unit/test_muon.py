"""Muon (deepspeed.runtime.zero.muon) in one process: the math against torch.optim.Muon + AdamW,
the config builder, the use_muon tagging rule and the owner plan of the ZeRO exchange.

Tolerances, measured on this suite's CPUs: the AdamW half is the same arithmetic as torch's
AdamW (~1e-6). The Muon half differs from torch.optim.Muon only in roundings of its bf16
Newton-Schulz ([Note: Muon semantics] in original_muon.py): torch's own bf16 result is ~2% (relative
Frobenius) from the exact iteration, upstream's unfused bf16 arithmetic ~4.5%, so the two sit
<= ~5% apart per update; "gram" computes in fp32 on CPUs without fp16 kernels (and in fp16, 11
mantissa bits, elsewhere) and sits within torch's own bf16 error.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.optimizers import build_optimizer
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import newton_schulz_gram, newton_schulz_standard
from deepspeed.runtime.zero.muon.sharded import assign_owners


def _params(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    matrices = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((21, 9), (13, 21), (16, 16))]
    others = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((11,), (7, 5))]
    return matrices, others


def _clone(ps: list) -> list:
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


@pytest.mark.parametrize("ns_method,tol", [("standard", 0.08), ("gram", 0.04)])
def test_muon_with_aux_adam_matches_torch_muon_and_adamw(ns_method: str, tol: float) -> None:
    matrices, others = _params()
    ref_m, ref_o = _clone(matrices), _clone(others)
    ours = MuonWithAuxAdam([dict(params=matrices, use_muon=True, lr=0.02, momentum=0.9, weight_decay=0.1,
                                 ns_method=ns_method),
                            dict(params=others, use_muon=False, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.1)])
    torch_muon = torch.optim.Muon(ref_m, lr=0.02, momentum=0.9, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(ref_o, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        before = [p.detach().clone() for p in matrices]
        for p, q in zip(matrices + others, ref_m + ref_o):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step(), torch_muon.step(), torch_adamw.step()
        for p, q in zip(others, ref_o):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for p, q, b in zip(matrices, ref_m, before):   # the updates, both from the same weights
            mine, theirs = p.detach() - b, q.detach() - b
            assert (mine - theirs).norm() / theirs.norm() < tol
            q.data.copy_(p.data)
    assert {k for s in ours.state.values() for k in s} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert all(set(ours.state[p]) == {"momentum_buffer"} for p in matrices)   # 4 bytes per Muon element


def test_gram_and_standard_newton_schulz_are_the_same_iteration() -> None:
    g = torch.randn(12, 40, dtype=torch.float64)
    for matrix in (g, g.T.contiguous(), g[:12, :12]):
        torch.testing.assert_close(newton_schulz_gram(matrix, torch.float64),
                                   newton_schulz_standard(matrix, torch.float64), rtol=1e-9, atol=1e-9)


def test_config_builder_splits_by_use_muon_and_reads_upstream_keys() -> None:
    matrices, others = _params()
    for p in matrices:
        p.use_muon = True
    for p in others:
        p.use_muon = False
    opt = build_optimizer("muon", {"lr": 1e-3, "muon_lr": 0.05, "momentum": 0.9, "weight_decay": 0.01,
                                   "ns_method": "standard", "betas": [0.8, 0.9], "eps": 1e-9},
                          matrices + others)
    muon, adam = opt.param_groups
    assert (muon["use_muon"], muon["lr"], muon["momentum"], muon["ns_method"], muon["name"]) == \
        (True, 0.05, 0.9, "standard", "muon-params")
    assert (adam["use_muon"], adam["lr"], adam["betas"], adam["eps"], adam["name"]) == \
        (False, 1e-3, (0.8, 0.9), 1e-9, "adam-params")
    assert muon["weight_decay"] == adam["weight_decay"] == 0.01
    defaults = build_optimizer("Muon", {}, matrices + others).param_groups
    assert (defaults[0]["lr"], defaults[0]["ns_method"], defaults[1]["lr"]) == (0.02, "gram", 3e-4)
    with pytest.raises(ValueError, match="optimizer.params.ns_method: got 'cubic'; accepted: 'gram', 'standard'"):
        build_optimizer("Muon", {"ns_method": "cubic"}, matrices + others)
    with pytest.raises(ValueError, match="optimizer.params.nesterov: not a parameter of optimizer type 'Muon'"):
        build_optimizer("Muon", {"nesterov": False}, matrices + others)
    with pytest.raises(ValueError, match="have no use_muon attribute"):
        build_optimizer("Muon", {}, [torch.nn.Parameter(torch.zeros(3, 3))])


def test_initialize_tags_by_upstream_rule_and_keeps_user_tags() -> None:
    from types import SimpleNamespace

    from deepspeed.runtime.builder import set_optimizer_flags

    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(5, 4), "block": torch.nn.Linear(4, 4),
                                 "norm": torch.nn.LayerNorm(4), "lm_head": torch.nn.Linear(4, 5),
                                 "router": torch.nn.Linear(4, 2, bias=False)})
    model["router"].weight.use_muon = False   # the user's tag wins over the shape rule
    config = SimpleNamespace(optimizer_name="Muon", optimizer_params={})   # upstream's DeepSpeedConfig names
    set_optimizer_flags(config, model)
    assert {n for n, p in model.named_parameters() if p.use_muon} == {"block.weight"}
    plain = torch.nn.Linear(3, 3)
    set_optimizer_flags(SimpleNamespace(optimizer_name="adamw", optimizer_params={}), plain)
    assert not hasattr(plain.weight, "use_muon")


def test_a_vector_tagged_muon_is_refused_by_name() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = MuonWithAuxAdam([dict(params=[p], use_muon=True)])
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"must be a matrix \(ndim >= 2\), got shape \(4,\)"):
        opt.step()


def test_owners_balance_matrices_largest_first() -> None:
    # 40 -> rank 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0 (40 < 50): 50 elements each
    assert assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]
    assert assign_owners([5, 5, 5], 4) == [0, 1, 2]
    assert assign_owners([7], 1) == [0]
