"""AutoEP's whole-block replacement pieces (no processes): split plan, router, repacking, the layer
against the block it replaces, config parsing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepspeed.module_inject.auto_ep import AutoEP
from deepspeed.module_inject.auto_ep_config import parse_autoep_config
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer, compute_split_plan
from deepspeed.moe.ep_kernels import local_ids_by_source
from deepspeed.moe.ep_repack import repack_expert_weights
from deepspeed.moe.ep_router import TokenChoiceTopKRouter


def test_split_plan_and_received_ids() -> None:
    plan = compute_split_plan(torch.tensor([[2, 0], [2, 3]]), 4, 1, 4, None)
    assert plan.input_splits == plan.output_splits == [4]
    assert plan.local_counts.tolist() == [1, 0, 2, 1]
    # from two sources, sorted by expert: source 0 sent 2 rows of local expert 1, source 1 one of each
    assert local_ids_by_source(torch.tensor([[0, 2], [1, 1]])).tolist() == [1, 1, 0, 1]


def test_router_group_limited_and_scaled() -> None:
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(8, 8, 4, 1, 2, "sigmoid", True, 2.5, False)
    scores, chosen, counts = router(torch.randn(32, 8))
    assert (chosen // 2).eq((chosen // 2)[:, :1]).all()   # both picks inside the one allowed group
    torch.testing.assert_close(scores.sum(dim=-1), torch.full((32,), 2.5))
    assert counts.sum() == 64 and counts.dtype == torch.int32


class _Block(nn.Module):
    """A Mixtral-style block computing its experts itself; gate_up stored [E, H, 2F] (hidden first)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 8, 12))
        self.experts.down_proj = nn.Parameter(torch.randn(4, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(2):
                gate, up = (x[t] @ self.experts.gate_up_proj[idx[t, k]]).chunk(2)
                out[t] += w[t, k] * ((nn.functional.silu(gate) * up) @ self.experts.down_proj[idx[t, k]])
        return out


def _model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Module()
    model.config = SimpleNamespace(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = _Block()
    return model


def test_layer_equals_the_block_it_replaces() -> None:
    model = _model()
    block = model.model.layers[0].mlp
    x = torch.randn(5, 8)
    want = block(x)
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True}))
    (spec,) = auto_ep.ep_parser()
    assert (spec.hidden_size, spec.ffn_hidden_size, spec.num_experts, spec.top_k) == (8, 6, 4, 2)
    w1, w2, w3 = repack_expert_weights(block.experts, spec, ep_rank=1, ep_size=2)   # experts 2, 3; transposed
    torch.testing.assert_close(torch.cat([w1, w3], dim=1), block.experts.gate_up_proj[2:].transpose(1, 2))
    torch.testing.assert_close(w2, block.experts.down_proj[2:].transpose(1, 2))
    layer = auto_ep.replace_moe_layer(spec, ep_size=1, ep_rank=0)
    assert isinstance(model.model.layers[0].mlp, AutoEPMoELayer)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in layer.experts.parameters())


@pytest.mark.parametrize("value", [0.01, False, "0.01"])
def test_load_balance_coeff_refused(value) -> None:
    with pytest.raises(ValueError, match=r"load_balance_coeff=.*not supported.*expert_bias.*null or omit"):
        parse_autoep_config({"enabled": True, "load_balance_coeff": value})


def test_autotp_class_shards_only_the_shared_experts_of_an_autoep_layer() -> None:
    """Upstream's AutoTP walk hands an AutoEP layer to `_replace_autoep_shared_experts`: a spec matching
    both the router's gate and the shared expert's gate_proj shards only the latter."""
    from deepspeed.module_inject.auto_tp import AutoTP, AutoTPConfig
    from deepspeed.module_inject.layers import LinearLayer

    model = _model()
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True}))
    (spec,) = auto_ep.ep_parser()
    layer = auto_ep.replace_moe_layer(spec, ep_size=1, ep_rank=0)
    layer.shared_experts = nn.Module()
    layer.shared_experts.gate_proj = nn.Linear(8, 6, bias=False)
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r".*gate(_proj)?\.weight$"],
                                                      "partition_type": "column"}]})
    autotp = AutoTP(module=model, partition_config=config)
    assert autotp._replace_module(model) is model
    assert isinstance(layer.shared_experts.gate_proj, LinearLayer)
    assert type(layer.router.gate) is nn.Linear


def test_folding_gradient_strategy_by_parameter_family() -> None:
    """auto_ep_folding's families: replicated (router, dense) average, marked partials sum, TP slices and
    experts skip (experts have no tp factor to cancel in this dispatch), nothing at tp 1."""
    from deepspeed.module_inject import auto_ep_folding as f

    tp, sp, one = (SimpleNamespace(tp_size=t, mp_mode=m) for t, m in ((2, "tp"), (2, "sp"), (1, "tp")))
    router, partial, norm, dense, expert, sliced = (nn.Parameter(torch.ones(2)) for _ in range(6))
    f.mark_autoep_folding_router_parameter(router)
    f.mark_autoep_folding_partial_router_parameter(partial)
    f.mark_autoep_folding_sp_sharded_layernorm_parameter(norm)
    expert.allreduce = False
    sliced.tensor_model_parallel = True
    got = {name: (f.autoep_folding_gradient_reduction_strategy(tp, p), f.autoep_folding_gradient_reduction_strategy(
        sp, p), f.autoep_folding_gradient_reduction_strategy(one, p))
           for name, p in (("router", router), ("partial", partial), ("norm", norm), ("dense", dense),
                           ("expert", expert), ("sliced", sliced))}
    assert got == {"router": ("average", "average", "skip"), "partial": ("sum", "sum", "skip"),
                   "norm": ("average", "sum", "skip"), "dense": ("average", "average", "skip"),
                   "expert": ("skip", "skip", "skip"), "sliced": ("skip", "skip", "skip")}
