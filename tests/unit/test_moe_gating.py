"""Gating of deepspeed.moe against DeepSpeed 0.19.8 (tests/fixtures/moe/gating.pt, made by
generate.py there), capacity arithmetic, and the layer's argument errors. On the machine that made the
fixtures the match is bit-exact ([Note: gating equals DeepSpeed 0.19.8] in deepspeed/moe/gating.py), but
the fixtures are stored: on another CPU (AVX-512 vs AVX2) softmax and the gate's matmul may round the last
bit differently, so float outputs are compared to 1e-6 and the integer ones (routes, masks, counts) exactly."""

import os

import pytest
import torch

from deepspeed.moe.gating import capacity_for
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "moe", "gating.pt")
CASES = torch.load(FIXTURE, weights_only=False)["cases"]
FUNCTIONS = {"top1": top1gating, "top2": top2gating, "topk": topkgating}


def _close(ours, theirs):
    if ours.is_floating_point():
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(ours, theirs), (ours, theirs)


def _assert_same(case, out):
    l_aux, combine, dispatch, exp_counts = out
    _close(l_aux.detach(), case["l_aux"])
    assert combine.shape == case["combine_weights"].shape   # capacity = combine.shape[2]
    _close(combine.detach(), case["combine_weights"])
    assert torch.equal(dispatch, case["dispatch_mask"])
    assert torch.equal(exp_counts, case["exp_counts"]) and exp_counts.dtype == case["exp_counts"].dtype


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c["kind"] in FUNCTIONS])
def test_gating_functions_equal_deepspeed_0_19_8(index):
    case = CASES[index]
    torch.manual_seed(case["seed"])   # RTS, RSample and top-2 sampling draw the same numbers in the same order
    _assert_same(case, FUNCTIONS[case["kind"]](case["logits"].clone(), **case["kwargs"]))


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c["kind"] == "gate"])
def test_topk_gate_equals_deepspeed_0_19_8(index):
    case = CASES[index]
    gate = TopKGate(case["input"].shape[1], case["weight"].shape[0], k=case["k"], capacity_factor=0.75,
                    eval_capacity_factor=1.5, min_capacity=2, noisy_gate_policy=case["noisy_gate_policy"])
    gate.train(case["training"])
    with torch.no_grad():
        gate.wg.weight.copy_(case["weight"])
    torch.manual_seed(case["seed"])
    _assert_same(case, gate(case["input"]))
    torch.manual_seed(case["seed"])
    sparse = gate(case["input"], None, True)
    want = case["sparse"]
    _close(sparse[0].detach(), want[0])
    assert int(sparse[1]) == int(want[1]) and sparse[2] == want[2]
    for ours, theirs in zip(sparse[3:6], want[3:6]):
        _close(ours.detach(), theirs)


def test_fixture_covers_dropping_and_no_dropping():
    dropped = [c for c in CASES if c["kind"] in FUNCTIONS and c["kwargs"]["drop_tokens"]
               and int(c["dispatch_mask"].sum()) < int(c["exp_counts"].sum())]
    kept = [c for c in CASES if c["kind"] in FUNCTIONS and not c["kwargs"]["drop_tokens"]]
    assert dropped and kept and all(int(c["dispatch_mask"].sum()) == int(c["exp_counts"].sum()) for c in kept)


@pytest.mark.parametrize("tokens,experts,factor,minimum,want", [
    (16, 4, 1.0, 2, 4), (16, 4, 0.5, 2, 2), (16, 4, 0.5, 3, 3), (10, 4, 1.0, 0, 3), (10, 3, 2.0, 0, 7),
    (0, 4, 1.0, 4, 4)])
def test_capacity_is_ceil_tokens_per_expert_times_factor(tokens, experts, factor, minimum, want):
    assert capacity_for(tokens, experts, factor, minimum) == want


def test_no_drop_capacity_is_the_largest_expert_load():
    logits = torch.tensor([[5.0, 0, 0, 0]] * 6 + [[0, 5.0, 0, 0]] * 2)
    _, combine, _, counts = top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    assert counts.tolist() == [6, 2, 0, 0] and combine.shape == (8, 4, 6)
    _, combine, dispatch, _ = top1gating(logits, 1.0, 0, drop_tokens=True, use_rts=False)
    assert combine.shape == (8, 4, 2) and int(dispatch.sum()) == 4   # expert 0 keeps 2 of its 6 tokens


def test_layer_argument_errors():
    expert = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"num_experts \(3\) must be a positive multiple of ep_size \(2\)"):
        MoE(4, expert, num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy must be one of"):
        MoE(4, expert, num_experts=2, noisy_gate_policy="Gumbel")
    with pytest.raises(ValueError, match="k must be between 1 and num_experts=2, got k=3"):
        MoE(4, expert, num_experts=2, k=3)
    with pytest.raises(ValueError, match="drop_policy must be 'probs' or 'position'"):
        topkgating(torch.zeros(4, 2), 1, 1.0, 0, drop_policy="random")
    layer = MoE(4, expert, num_experts=2, min_capacity=4)
    with pytest.raises(ValueError, match="fewer tokens than min_capacity"):
        layer(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="last dim is not the gate's model_dim"):
        layer(torch.zeros(8, 5))
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        MoE(4, expert, num_experts=2, ep_size=2)(torch.zeros(8, 4))


def test_experts_are_marked_for_the_engine_and_residual_mixes():
    torch.manual_seed(0)
    expert = torch.nn.Linear(4, 4)
    layer = MoE(4, expert, num_experts=4, ep_size=2, k=2, use_residual=True)
    experts = list(layer.deepspeed_moe.experts.deepspeed_experts)
    assert len(experts) == 2 and all(e is not expert for e in experts)
    for p in layer.deepspeed_moe.experts.parameters():
        assert p.allreduce is False and p.group_name == "ep_size_2"
    assert not hasattr(layer.deepspeed_moe.gate.wg.weight, "allreduce") and layer.mlp is expert
    with pytest.warns(UserWarning, match="Tutel"):
        MoE(4, expert, num_experts=2, use_tutel=True)


def test_bf16_layer_routes_like_fp32_and_keeps_dtype():
    """bf16 experts, fp32 gate (the gate upcasts its input and weight, as upstream): the same routes
    as an fp32 copy fed the same (bf16-representable) values; outputs to bf16 precision."""
    import copy

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    layer = MoE(8, expert, num_experts=4, k=2, min_capacity=2, capacity_factor=0.75).to(torch.bfloat16)
    ref = copy.deepcopy(layer).float()
    x = torch.randn(3, 8, 8).to(torch.bfloat16)
    torch.manual_seed(3)
    out, l_aux, counts = layer(x)
    torch.manual_seed(3)
    want, want_l_aux, want_counts = ref(x.float())
    assert out.dtype == torch.bfloat16 and torch.equal(counts, want_counts) and torch.equal(l_aux, want_l_aux)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
