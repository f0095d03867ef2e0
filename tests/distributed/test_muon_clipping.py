"""Muon and `gradient_clipping` ([Note: Muon and gradient clipping] in zero/muon/sharded.py).

`gradient_clipping` (default 1.0, as upstream) clips the raw gradients by their global norm, and
Muon and AdamW then step from the clipped gradients: `torch.nn.utils.clip_grad_norm_` followed by
`torch.optim.Muon` + `torch.optim.AdamW`, at every ZeRO stage. DeepSpeed 0.19.8 does this at
stage 0 only; at stages 1-3 it orthogonalises first and clips the Muon updates together with the
AdamW gradients, which divides every Muon step by the norm of the updates (a property of the
model's shapes, not of the gradient). The test checks each step, taken from the same weights,
against torch's optimizers and against Muon's formula in fp64, and that the clip upstream's
stages 1-3 would apply here is large enough (the updates' norm is over twice the threshold) that
the tolerance would catch it.

Tolerances (relative Frobenius distance of each Muon update, from the same weights): "gram" is
the exact iteration in fp32 on CPUs without oneDNN fp16 (measured here: <= 7e-6 from the formula
in fp64) and in fp16 elsewhere (bound: 5%); torch.optim.Muon computes in bf16, which on these
rank-8 gradients puts it up to 19% from the fp64 formula (bound: 25%). Upstream's clip at stages
1-3 would take each Muon step here at least 50% away from both. AdamW: fp32's rounding.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from muon_jobs import make_net, muon_config, muon_train, reference_steps

STEPS = 3
MUON = ("up.weight", "down.weight")
LR, MUON_LR, CLIP = 3e-3, 0.02, 1.0


@pytest.mark.parametrize("loss_mult", [0.1, 100.0], ids=["norm-below-clip", "norm-above-clip"])
@pytest.mark.parametrize("world,stage", [(1, 0), (1, 1), (1, 3), (2, 2)])
def test_gradient_clipping_clips_raw_gradients_before_muon(world: int, stage: int, loss_mult: float) -> None:
    config = muon_config(stage, 1, world, ns_method="gram", weight_decay=0.0)
    config["gradient_clipping"] = CLIP
    ours = run_distributed(world, muon_train, config, STEPS, loss_mult=loss_mult)[0]
    ref = reference_steps(ours["history"], lr=LR, muon_lr=MUON_LR, wd=0.0, clip=CLIP, loss_mult=loss_mult)
    for step, (got, want) in enumerate(zip(ours["history"], ref)):
        start = ours["history"][step - 1] if step else _initial()
        # the norm the engine reports is the raw gradients' (what the clip compared with 1.0)
        assert ours["norms"][step] == pytest.approx(want["norm"], rel=1e-5)
        assert (want["norm"] > CLIP) == (loss_mult > 1), want["norm"]   # the regime the id names
        updates = {}
        for name in MUON:
            mine = got[name] - start[name]
            for what, want_p, tol in (("the fp64 formula", want["exact"][name], 0.05),
                                      ("torch.optim.Muon", want["params"][name], 0.25)):
                theirs = want_p - start[name]
                gap = ((mine - theirs).norm() / theirs.norm()).item()
                assert gap < tol, f"stage {stage}, {world} ranks, step {step}, {name}: {gap:.4f} from {what}"
            updates[name] = mine / -MUON_LR
        for name in got:
            if name not in MUON:
                torch.testing.assert_close(got[name], want["params"][name], rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage}, {world} ranks, step {step}: {name}")
        # DeepSpeed 0.19.8 at ZeRO 1-3: the norm of [Muon updates, AdamW gradients] against the clip
        upstream_norm = torch.linalg.vector_norm(torch.stack(
            [u.norm() for u in updates.values()] + [g.norm() for n, g in want["grads"].items() if n not in MUON]))
        assert upstream_norm > 2 * CLIP, upstream_norm   # its Muon step here: < half of torch's


def _initial() -> dict:
    return {n: p.detach() for n, p in make_net().named_parameters()}
