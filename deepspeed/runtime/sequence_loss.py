"""How a loss under sequence parallelism is scaled for backward.

[Note: sequence-parallel gradient scale]
ZeRO (every stage) shards over, and gradients are averaged over, the sequence-data-parallel group
(data x sequence: every rank holding a replica of the parameters), dividing by its size sp x dp. Clients
hand `engine.backward` one of two kinds of loss under sequence parallelism:

* "whole": the replica's whole loss on every SP rank (ALST and Hugging Face's `deepspeed_sp_compute_loss`:
  per-shard losses joined by a differentiable all_gather, so each SP rank holds the same value and its
  backward sends each shard's gradient sp times): averaging over sp x dp gives the exact gradient;
* "share": each SP rank its share of the replica's loss, the shares adding up to it (the local-slice
  convention of Megatron-DeepSpeed with `DistributedAttention`): the SP ranks' gradients add up to the
  replica's, so the engine multiplies such a loss by sp before backward and the same average is exact again.

The convention comes from where the loss comes from, first of:
1. `engine.sequence_parallel_loss = "whole" | "share"`, set by the client (or by ALST's
   `UlyssesSPFwdLossBwdWithLogits`, which makes a whole loss);
2. "whole" when ALST's Ulysses attention (`UlyssesSPAttentionHF`, registered with transformers: the HF
   Trainer, Accelerate, ALST loops) ran in this engine's model: those clients join the shard losses;
3. unknown: then, and only then, a value test at every backward (one all_gather of the scalar over the SP
   group and a host sync): equal on every SP rank (to 1e-6 relative) is "whole", else "share". It cannot
   tell a share from a whole loss when the shares happen to coincide: declare the convention there.
A known "whole" is cross-checked by the same value test once, at the first backward: a loss that differs
across the SP ranks raises, naming both ways out. A known "share" cannot be checked (shares may coincide)
and costs nothing. So gradients, clipping and the logged grad norm are exact at every ZeRO stage (upstream
divides by dp at stages 0-2 and by sp x dp at stage 3, so one of the two conventions is off by sp at
each). A bare `loss.backward()` scales by sp for a known "share" and by 1 otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm as ds_comm


SEQUENCE_LOSS_CONVENTIONS = ("whole", "share")


def sequence_loss_factor(engine: Any, loss: torch.Tensor | None = None) -> int:
    """1 for a "whole" loss on every SP rank, sp for per-rank "share"s: [Note: sequence-parallel gradient
    scale]. `loss` None: a bare `loss.backward()` (no value to test). Collective over the SP group only
    while the convention is unknown, and once to cross-check a known "whole"."""
    sp = engine.sequence_parallel_size
    if sp <= 1:
        return 1
    convention = sequence_loss_convention(engine)
    if loss is None:
        return sp if convention == "share" else 1
    if convention is None:
        return 1 if _equal_on_sp_ranks(engine, loss)[0] else sp
    if convention == "whole" and not getattr(engine, "_sp_whole_checked", False):
        engine._sp_whole_checked = True
        equal, values = _equal_on_sp_ranks(engine, loss)
        if not equal:
            raise ValueError(
                f"sequence parallelism: the loss handed to backward differs across the {sp} sequence-parallel ranks "
                f"({values}), but this engine takes it as the replica's whole loss on every rank ({_why(engine)}). "
                "Join the per-rank losses as transformers' deepspeed_sp_compute_loss does (all_gather, weighted "
                "by valid tokens), or, if each rank's loss is its share of the replica's (the shares add up to "
                "it), set engine.sequence_parallel_loss = 'share'")
    return sp if convention == "share" else 1


def sequence_loss_convention(engine: Any) -> str | None:
    """"whole", "share" or None (unknown): declared, else "whole" where ALST's attention ran in the model."""
    declared = getattr(engine, "sequence_parallel_loss", None)
    if declared is not None:
        if declared not in SEQUENCE_LOSS_CONVENTIONS:
            raise ValueError(f"engine.sequence_parallel_loss={declared!r}: use 'whole' (the replica's loss on every "
                             "sequence-parallel rank), 'share' (each rank its share, adding up to it) or None")
        return declared
    if getattr(engine, "_sp_alst_seen", None) is None:   # looked up at the first backward, after a forward ran
        engine._sp_alst_seen = any(getattr(m, "_ds_ulysses_sp", False) for m in engine.module.modules())
    return "whole" if engine._sp_alst_seen else None


def _why(engine: Any) -> str:
    if getattr(engine, "sequence_parallel_loss", None) is not None:
        return "engine.sequence_parallel_loss = 'whole'"
    return "ALST's Ulysses attention (UlyssesSPAttentionHF) runs in the model, whose clients join the shard losses"


def _equal_on_sp_ranks(engine: Any, loss: torch.Tensor) -> tuple[bool, list[float]]:
    """Whether the loss is the same on every SP rank (to 1e-6 relative: a last-bit difference is still one
    loss) and the values; one all_gather of the scalar and a host sync."""
    value = loss.detach().reshape(1).to(torch.float64)
    gathered = [torch.empty_like(value) for _ in range(engine.sequence_parallel_size)]
    ds_comm.all_gather(gathered, value, group=engine.seq_parallel_group)
    values = [float(g) for g in gathered]
    first = values[0]
    same = [v == first or (v != v and first != first) or abs(v - first) <= 1e-6 * abs(first) for v in values]
    return all(same), values
