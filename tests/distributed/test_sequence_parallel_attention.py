"""Ulysses attention against the full sequence in one process: `deepspeed.sequence.layer.DistributedAttention`
and ALST's HF attention + data adapter (`deepspeed.runtime.sequence_parallel.ulysses_sp`).

Not bit-equal: attention sums and the gradient partial sums run in another order than the full-sequence
run's, so ~1e-6 absolute (fp32)."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from sp_attention_jobs import (adapter_batches, alst_disable_in_eval, alst_llama, distributed_attention,
                              exchange_roundtrip)


@pytest.mark.parametrize("sp,heads,kv_heads,batch_first", [
    (2, 4, 4, False),   # sp=2 x 2 replicas, [s, b, h, d]
    (4, 4, 4, False),   # sp=4
    (4, 8, 4, True),    # batch-first, GQA (kv heads divisible by sp)
    (4, 6, 6, False),   # uneven heads: 2, 2, 1, 1
])
def test_distributed_attention_matches_full_sequence(sp, heads, kv_heads, batch_first):
    results = run_distributed(4, distributed_attention, sp, heads, kv_heads, batch_first)
    layers, world = 2, 4
    for r in results:
        assert r["out_err"] < 2e-6 and r["xgrad_err"] < 2e-6 and r["grad_err"] < 1e-5, r
        assert r["fwd_count"] == 4 * layers and r["total_count"] == 8 * layers, r
        if heads % sp == 0:   # even heads: what this rank sends is exactly its share
            assert r["fwd_bytes"] == r["theory_fwd_bytes"], r
            assert r["total_bytes"] == 2 * r["theory_fwd_bytes"], r
    if heads % sp != 0:   # uneven: ranks send different amounts, the group total is the theory's
        assert sum(r["fwd_bytes"] for r in results) == sum(r["theory_fwd_bytes"] for r in results)


@pytest.mark.parametrize("sp,heads,batch_first", [(2, 4, False), (4, 7, True), (4, 3, False)])
def test_exchange_places_heads_and_round_trips(sp, heads, batch_first):
    assert run_distributed(4, exchange_roundtrip, sp, heads, batch_first) == [0.0] * 4


@pytest.mark.parametrize("sp", [2, 4])   # sp=4 with 2 kv heads: kv heads replicated
def test_alst_llama_matches_full_sequence(sp):
    for errs in run_distributed(4, alst_llama, sp):
        assert errs["logits"] < 1e-5 and errs["loss"] < 1e-5 and errs["grad"] < 1e-5, errs


def test_alst_disable_in_eval_bypasses_only_in_eval():
    assert max(run_distributed(2, alst_disable_in_eval, 2)) < 1e-5


def test_adapter_shards_and_shifts_labels():
    results = run_distributed(2, adapter_batches, 2)
    for sp_rank, batches in enumerate(results):
        assert len(batches) == 2
        for step, b in enumerate(batches):   # step i is rank i's sample
            ids = torch.tensor([[1, 10, 10, 10, 2, 2]]) + 100 * step
            shift = torch.cat([ids[:, 1:], torch.tensor([[-100]])], dim=1)
            half = slice(3 * sp_rank, 3 * sp_rank + 3)
            assert torch.equal(b["input_ids"], ids[:, half])
            assert torch.equal(b["position_ids"], torch.arange(6).view(1, -1)[:, half])
            # rank 0's last token keeps its target (rank 1's first token); the sample's last has none
            assert torch.equal(b["shift_labels"], shift[:, half])
            assert "labels" not in b and b["tag"] == step
