"""Muon under ZeRO over real gloo processes: the sharding must not change the math.

[Note: Muon under ZeRO] (deepspeed/runtime/zero/muon/sharded.py): every Muon matrix is
orthogonalised whole on one owner rank from the same bits an unsharded run has, so ZeRO 0-3 at
1, 2 and 4 ranks and GAS 1 and 2 are compared with one unsharded run, step by step. The runs
use ns_method "standard", whose Newton-Schulz rounds its input to bf16 on every CPU: the fp32
roundings by which the gradients of these runs differ (reduction order, accumulation) then
vanish, and the Muon weights come out bit-identical (measured on this machine for all 24
combinations). A gradient an ulp apart can still flip one bf16 rounding on other hardware, so
the test asserts that almost every element is bit-identical and the rest within a bf16 ulp of
the update (lr * 2^-6 per step), where a misplaced fragment would be off by lr itself. The
AdamW half runs on flat shards and is compared to fp32's rounding ([Note: bit equality in
tests] in tests/README.md).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from muon_jobs import muon_config, muon_train

STEPS = 3
MUON = ("up.weight", "down.weight")
MUON_NUMEL = 21 * 9 + 13 * 21
ADAM_NUMEL = 11 * 9 + 21 + 2 * 21 + 13 + 13 * 11 + 11   # embed, up.bias, norm, down.bias, lm_head
MUON_LR = 0.02
STANDARD = {"ns_method": "standard"}


@pytest.fixture(scope="module")
def unsharded() -> dict:
    return run_distributed(1, muon_train, muon_config(0, 1, 1, **STANDARD), STEPS)[0]


def _assert_same_updates(got: list, want: list, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for name in w:
            if name in MUON:
                same = (g[name] == w[name]).float().mean().item()
                gap = (g[name] - w[name]).abs().max().item()
                assert same >= 0.99 and gap <= MUON_LR * 2**-6 * (step + 1), f"{what}: step {step} {name}: {same}, {gap}"
            else:
                torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=1e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize("world,stage,gas", [(1, 3, 2), (2, 0, 2), (2, 1, 1), (2, 2, 2), (2, 3, 1),
                                             (4, 1, 2), (4, 2, 1), (4, 3, 2)])
def test_muon_updates_identical_across_stages_ranks_and_gas(unsharded: dict, world: int, stage: int, gas: int) -> None:
    results = run_distributed(world, muon_train, muon_config(stage, gas, world, **STANDARD), STEPS)
    _assert_same_updates(results[0]["history"], unsharded["history"], f"stage {stage}, {world} ranks, GAS {gas}")
    # momentum: one fp32 per Muon element in all, sharded 1/N (up to the cut of the buckets)
    held = [r["momentum_bytes"] for r in results]
    if stage == 0:
        assert held == [4 * MUON_NUMEL] * world, held
    else:
        assert sum(held) == 4 * MUON_NUMEL and max(held) <= 4 * (-(-MUON_NUMEL // world) + 24), held


def test_muon_tags_follow_upstream_rule_and_wire_bytes_are_counted(unsharded: dict) -> None:
    tags = unsharded["tags"]
    assert [n for n, muon in tags.items() if muon] == list(MUON)   # embed, lm_head, biases, norm: AdamW
    assert unsharded["momentum_bytes"] == 4 * MUON_NUMEL
    assert unsharded["wire"] == [0] * STEPS        # one rank: nothing to move
    results = run_distributed(2, muon_train, muon_config(3, 1, 2, **STANDARD), 1)
    # stage 3 at 2 ranks splits each matrix in halves (ceil first). down (273) is the larger, so
    # rank 0 owns it and rank 1 owns up (189). Off their owner: up's first 95 elements and down's
    # last 136, each sent to the owner and back in bf16 (2 bytes): 2 * 2 * 231 bytes, evenly.
    assert [r["wire"][0] for r in results] == [2 * (95 + 136)] * 2


def test_muon_checkpoint_resumes_on_another_world_size(unsharded: dict, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(2, muon_train, muon_config(1, 1, 2, **STANDARD), 1, path)
    resumed = run_distributed(4, muon_train, muon_config(3, 1, 4, **STANDARD), STEPS - 1, None, path, 1)
    _assert_same_updates(resumed[0]["history"], unsharded["history"][1:], "saved at 2 ranks ZeRO-1, resumed at 4 ZeRO-3")
    # Muon fragments get their momentum back and nothing else (the file holds every field for
    # every group): 4 bytes per Muon element, 8 (exp_avg, exp_avg_sq) per AdamW element
    assert sum(r["momentum_bytes"] for r in resumed) == 4 * MUON_NUMEL
    assert sum(r["state_bytes"] for r in resumed) == 4 * MUON_NUMEL + 8 * ADAM_NUMEL
    back = run_distributed(1, muon_train, muon_config(0, 1, 1, **STANDARD), STEPS - 1, None, path, 1)[0]
    _assert_same_updates(back["history"], unsharded["history"][1:], "resumed unsharded")
