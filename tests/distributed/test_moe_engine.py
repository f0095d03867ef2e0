"""Expert parallelism in the engine: expert gradients over their expert-data-parallel groups, ZeRO 0-2
with experts, the global norm, the same update at every ep_size ([Note: expert gradients])."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from moe_jobs import merged, reference, train

STEPS = 10


def _check(results: list[dict], ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    state = merged(results)
    assert set(state) == set(ref["state"])
    for name, value in ref["state"].items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_moe_matches_dense_reference(stage: int, world: int, ep: int) -> None:
    """10 SGD steps at ep>1 equal one process holding every expert on the whole global batch (so the
    update is the same at every ep_size: no #6545 skew)."""
    _check(run_distributed(world, train, ep, STEPS, {"stage": stage}), reference(world, STEPS))


def test_moe_ep_sizes_agree() -> None:
    """ep=1 (replicated experts), 2 and 4 on the same 4-rank global batch give the same parameters."""
    runs = {ep: merged(run_distributed(4, train, ep, STEPS, {"stage": 1})) for ep in (1, 2, 4)}
    for ep in (2, 4):
        for name, value in runs[1].items():
            torch.testing.assert_close(runs[ep][name], value, rtol=1e-5, atol=1e-6, msg=f"ep={ep} {name}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moe_clipping_counts_each_expert_once(stage: int) -> None:
    """The global norm (and so the clipped update) equals the reference's over all parameters."""
    clip = 0.05
    results = run_distributed(4, train, 2, STEPS, {"stage": stage, "clip": clip})
    ref = reference(4, STEPS, clip=clip)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
    assert min(ref["norms"]) > clip   # clipping was active at every step
    _check(results, ref)


def test_moe_gradient_accumulation() -> None:
    _check(run_distributed(2, train, 2, 4, {"stage": 2, "micro_gas": 2}), reference(2, 4, micro_gas=2))


@pytest.mark.parametrize("stage", [0, 2])
def test_moe_bf16(stage: int) -> None:
    """bf16 parameters (fp32 masters) track the fp32 reference within bf16's precision."""
    results = run_distributed(2, train, 2, 5, {"stage": stage, "bf16": True})
    _check(results, reference(2, 5), rtol=3e-2, atol=3e-2)


def test_moe_zero3_with_ep_raises() -> None:
    with pytest.raises(Exception, match=r"zero_optimization.stage=3.*ep_size=2"):
        run_distributed(2, train, 2, 1, {"stage": 3})
