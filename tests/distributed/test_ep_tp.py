"""Expert parallelism x tensor parallelism ([Note: EP x TP folding] in deepspeed/moe/tp_tokens.py): AutoEP
(`expert_parallel.autoep_size`) with AutoTP (`tensor_parallel.autotp_size`) on 4 gloo ranks (tp 2 x ep 2,
dp 2), and `deepspeed.moe.layer.MoE` with a Megatron-style mpu (upstream's test_moe_tp.py layout), against
one process on the unsharded model and the same global batch (eptp_jobs.py)."""

from __future__ import annotations

import pytest
import torch

from eptp_jobs import (folded_layer_grads, folded_routing_differs, moe_reference, moe_strided_mpu_refused, reference,
                       refused, train_autoep_autotp, train_moe_mpu)
from harness import run_distributed
from moe_jobs import reference as plain_moe_reference
from moe_jobs import train as train_plain_moe


STEPS, LR, CLIP = 3, 0.1, 0.5   # every step clips (the norms are 1.5-2.7): a norm off by any factor moves the weights


def _check(kind: str, stage: int) -> None:
    ref = reference(kind, STEPS, 2, LR, CLIP)
    results = run_distributed(4, train_autoep_autotp, kind, STEPS, 2, 2, stage, LR, CLIP)
    # the folded layout (upstream's): expert groups = runs of 2 consecutive ranks (here the tensor pairs)
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["edp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert min(ref["norms"]) > CLIP
    _same_as(ref, results)


def _same_as(ref: dict, results: list) -> None:
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    for step in range(STEPS):   # the global loss: the mean of the data shards' (equal token counts)
        loss = (results[0]["losses"][step] + results[2]["losses"][step]) / 2
        assert loss == pytest.approx(ref["losses"][step], rel=1e-5)
        for r in results:
            assert r["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-5), (step, r["norms"], ref["norms"])
    for r in results:
        assert sorted(r["state"]) == sorted(ref["state"])
        for name, want in ref["state"].items():
            torch.testing.assert_close(r["state"][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind,stage", [("mixtral", 2), ("qwen3_moe", 0)])
def test_autoep_autotp_matches_one_process(kind: str, stage: int) -> None:
    """Losses per step, the clipped global norm (experts, TP shards and TP-replicated parameters each
    counted once) and the final whole weights equal one process's, fp32, at rel 1e-5."""
    _check(kind, stage)


@pytest.mark.slow
@pytest.mark.parametrize("kind,stage", [("mixtral", 1)])
def test_autoep_autotp_matches_one_process_more(kind: str, stage: int) -> None:
    _check(kind, stage)


def test_autoep_autotp_refusals() -> None:
    """What does not combine is refused on every rank, at initialize, naming both dims."""
    for errors in (run_distributed(4, refused, "mixtral", 2, 2, 3, {}),):
        assert len(set(errors)) == 1 and "NotSupportedYet" in errors[0], errors
        assert all(k in errors[0] for k in ("autoep_size=2", "autotp_size=2", "stage 3")), errors[0]
    errors = run_distributed(4, refused, "mixtral", 2, 2, 1, {"sequence_parallel_size": 2})
    assert len(set(errors)) == 1 and "sequence_parallel_size=2" in errors[0] and "autoep_size=2" in errors[0], errors


@pytest.mark.parametrize("stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_moe_with_mpu_matches_one_process(stage: int) -> None:
    """MoE(ep_size=2, top-2) after a replicated dense layer, a Megatron-style mpu of tensor pairs (tp 2 x dp 2):
    upstream's E + M + D expert groups inside the tensor lanes ({0,2} {1,3}); each tensor peer sends its share
    of the capacity slots; losses (with l_aux), clipped norm and every expert's final weights equal one process
    holding all 4 experts on the same data shards."""
    ref = moe_reference(STEPS, 2, 0.5, 0.3)
    results = run_distributed(4, train_moe_mpu, STEPS, 2, 2, stage, 0.5, 0.3)
    assert [r["ep_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["expert_tp"] == 1 for r in results)
    assert min(ref["norms"]) > 0.3
    _same_as(ref, results)


def test_plain_moe_engine_after_an_ep_tp_engine_in_the_same_processes() -> None:
    """An EP x TP engine's mesh (tensor lanes) stays current after it; the next job's bare
    `groups._create_expert_and_data_parallel(2)` (upstream's tests build their experts after it) asks
    for tensor 1 and must get the plain layout the next engine uses, not expert groups inside the old
    lanes (the replicas then held different experts and trained apart). Same 4 pool processes."""
    from test_moe_engine import STEPS as PLAIN_STEPS
    from test_moe_engine import _check as check_plain

    run_distributed(4, train_moe_mpu, 1, 2, 2, 1, 0.5, 0.3)
    check_plain(run_distributed(4, train_plain_moe, 2, PLAIN_STEPS, {"stage": 1}), plain_moe_reference(4, PLAIN_STEPS))


def test_moe_under_an_mpu_with_strided_tensor_peers_is_refused() -> None:
    """Expert groups lie inside tensor lanes of consecutive ranks (Megatron's order); an mpu whose tensor
    peers are strided would route tokens to experts on ranks that never saw them: refused on every rank."""
    errors = run_distributed(4, moe_strided_mpu_refused)
    assert all(e.startswith("ValueError") and "consecutive ranks" in e for e in errors), errors
    assert "[0, 2]" in errors[0] and "[0, 1]" in errors[0], errors[0]


@pytest.mark.parametrize("score_apply", ["post", "pre"])
def test_folded_assignment_dispatch_matches_whole_layer(score_apply: str) -> None:
    """[Note: folded assignment dispatch]: 2 tensor peers sharing an AutoEPMoELayer's assignments give
    its whole output and the whole input and router gradients on both peers; each expert row is
    computed once, so the peers' expert gradients sum to the whole ones."""
    first, second = run_distributed(2, folded_layer_grads, score_apply)
    want = first["whole"]
    assert sorted(first["folded"]) == sorted(want)
    for got in (first["folded"], second["folded"]):
        for name in ("out", "x", "router.gate.weight"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name in [n for n in want if n.startswith("experts.")]:
        torch.testing.assert_close(first["folded"][name] + second["folded"][name], want[name], rtol=1e-5,
                                   atol=1e-6)
        assert first["folded"][name].abs().sum() > 0 and second["folded"][name].abs().sum() > 0


def test_validate_folding_routing_refuses_diverging_peers() -> None:
    """`validate_folding_routing`: tensor peers that route differently all raise before dispatching."""
    for message in run_distributed(2, folded_routing_differs):
        assert "routing decisions differ across tensor-parallel lanes" in message


def test_autotp_shards_autoep_shared_experts() -> None:
    """AutoTP's automatic plan shards a whole-block AutoEP layer's shared experts (column gate/up, row
    down; upstream's AutoTP does too), the router and the routed experts stay whole, and the folded
    layer still gives the whole output and gradients (each rank's shard gradient = its slice of the whole)."""
    results = run_distributed(2, folded_layer_grads, "post", True)
    prefix = "model.layers.0.mlp.shared_experts."
    assert results[0]["plan"] == {"column": [prefix + "gate_proj", prefix + "up_proj"], "row": [prefix + "down_proj"],
                                  "skip": ["model.layers.0.mlp.router.gate"]}
    want = results[0]["whole"]
    for rank, got in enumerate(results):
        for name in ("out", "x", "router.gate.weight"):
            torch.testing.assert_close(got["folded"][name], want[name], rtol=1e-6, atol=1e-6)
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            key = f"shared_experts.{name}.weight"
            torch.testing.assert_close(got["folded"][key], want[key].chunk(2, dim=dim)[rank], rtol=1e-6, atol=1e-6)
