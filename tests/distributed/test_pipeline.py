"""PipelineEngine on real gloo processes: training equals plain PyTorch on the same global
batch (tied embedding/head, activation checkpointing, gradient accumulation, ZeRO 0-2), eval,
exactly one message per micro-batch and boundary, and a failing stage stops every rank."""

from __future__ import annotations

import re

import pytest
import torch

import pipe_jobs as jobs
from harness import DistributedTestError, run_distributed


def reference(steps, micro, gas, dp, with_mask=False, clip=0.0):
    embed, blocks = jobs.reference_layers(with_mask)
    params = list(embed.parameters()) + [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        _, (ids, labels) = jobs.batches(step, 0, micro, gas, dp)
        loss = jobs.loss_fn(jobs.reference_forward(embed, blocks, ids), labels)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(loss.item())
    named = {"tied_modules.embed.weight": embed.weight.detach()}
    for i, b in enumerate(blocks):
        named[f"{i + 1}.fc.weight"] = b.fc.weight.detach()
        named[f"{i + 1}.fc.bias"] = b.fc.bias.detach()
    return losses, named


def check(results, steps, micro, gas, stages, with_mask=False, clip=0.0, rtol=1e-5, atol=1e-6):
    dp = len(results) // stages
    want_losses, want = reference(steps, micro, gas, dp, with_mask, clip)
    seen = set()
    for losses, params, meta, _ in results:
        assert losses == pytest.approx(want_losses, rel=rtol, abs=atol), meta
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name} {meta}: {m}")
            seen.add(name)
    assert seen == set(want), f"parameters missing from every stage: {set(want) - seen}"


@pytest.mark.parametrize("stages,world,gas,zero,ac", [
    (2, 2, 4, 0, 0),    # 2 stages
    (4, 4, 4, 0, 1),    # 4 stages, activation checkpointing every layer
    (2, 4, 4, 1, 0),    # 2 stages x 2 replicas, ZeRO-1
    (2, 4, 1, 2, 1),    # 2 x 2, ZeRO-2 (upstream refuses it), GAS 1, checkpointing
])
def test_training_matches_plain_pytorch(stages, world, gas, zero, ac):
    steps, micro = 10, 2
    results = run_distributed(world, jobs.train, stages, micro, gas, zero, steps, ac)
    check(results, steps, micro, gas, stages)
    assert {r[2]["stage"] for r in results} == set(range(stages))


def test_tuple_activations_with_mask_and_clipping():
    steps, micro, gas = 6, 2, 2
    results = run_distributed(4, jobs.train, 4, micro, gas, 0, steps, 0, True, "fp32", 0.05)
    check(results, steps, micro, gas, 4, with_mask=True, clip=0.05)
    norms = {r[2]["norm"] for r in results}
    assert len(norms) == 1 and None not in norms   # one global norm, tied weight counted once


@pytest.mark.parametrize("dtype,zero", [("bf16", 1), ("fp16", 2)])
def test_half_precision_tracks_fp32(dtype, zero):
    """bf16 / fp16 (loss scaled on the last stage, unscaled and overflow-checked over all stages)."""
    steps, micro, gas = 6, 2, 2
    results = run_distributed(4, jobs.train, 2, micro, gas, zero, steps, 0, False, dtype, 1.0)
    want_losses, _ = reference(steps, micro, gas, 2, clip=1.0)
    scales = {r[2]["loss_scale"] for r in results}
    assert len(scales) == 1, scales
    for losses, params, meta, _ in results:
        assert losses == pytest.approx(want_losses, rel=3e-2), meta
        assert losses[-1] < losses[0]


def test_one_message_per_micro_batch_and_boundary():
    """After the first step (shapes exchanged once), each stage boundary carries per micro-batch
    exactly one activation message and one gradient message, each the activation's size."""
    micro, gas, stages = 2, 4, 2
    results = run_distributed(2, jobs.train, stages, micro, gas, 0, 3)
    act_bytes = micro * jobs.SEQ * jobs.HIDDEN * 4
    for _, _, meta, counts in results:
        steady = counts[1:]
        for c in steady:
            assert c["send"] == (gas, gas * act_bytes), (meta, c)
            assert c["recv"] == (gas, gas * act_bytes), (meta, c)
        if meta["stage"] == 0:
            assert counts[0]["send"][0] == gas + 2   # the first step also sent the shapes (length, meta)


def test_set_dataloader_feeds_train_batch():
    by_iter = run_distributed(2, jobs.train, 2, 2, 2, 0, 2)
    by_loader = run_distributed(2, jobs.train, 2, 2, 2, 0, 2, loader=True)
    for (losses, params, _, _), (losses_l, params_l, _, _) in zip(by_iter, by_loader):
        assert losses_l == losses
        for name, value in params.items():
            assert torch.equal(params_l[name], value), name   # same data, same order: same bits


def test_eval_batch_equals_module_output():
    micro, gas, stages = 2, 2, 2
    results = run_distributed(4, jobs.evaluate, stages, micro, gas)
    losses = {round(r[0], 6) for r in results}
    assert len(losses) == 1
    # the trained weights (every stage) rebuilt into the plain model, evaluated on the same data
    embed, blocks = jobs.reference_layers()
    merged = {}
    for _, _, params, _ in results:
        merged.update(params)
    with torch.no_grad():
        embed.weight.copy_(merged["tied_modules.embed.weight"])
        for i, b in enumerate(blocks):
            b.fc.weight.copy_(merged[f"{i + 1}.fc.weight"])
            b.fc.bias.copy_(merged[f"{i + 1}.fc.bias"])
        want_losses = []
        for replica in range(2):
            data, _ = jobs.batches(7, replica, micro, gas, 2)
            for ids, labels in data:
                want_losses.append(jobs.loss_fn(jobs.reference_forward(embed, blocks, ids), labels))
        assert results[0][0] == pytest.approx(torch.stack(want_losses).mean().item(), rel=1e-5)
        for loss, logits, _, replica in results:
            if logits is not None:
                data, _ = jobs.batches(7, replica, micro, gas, 2)
                for got, (ids, _) in zip(logits, data):
                    torch.testing.assert_close(got, jobs.reference_forward(embed, blocks, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages,fail_stage", [(4, 1), (2, 1)])
def test_failing_stage_stops_every_rank(stages, fail_stage):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(4, jobs.failing_stage, stages, fail_stage, timeout=60)
    text = str(info.value)
    outcomes = re.findall(r"OUTCOME stage=(\d+) after=([\d.]+)s (\w+): ([^\n]*)", text)
    assert len(outcomes) == 4, text
    for stage, after, kind, message in outcomes:
        assert kind == "PipelineError", message
        assert float(after) < 10.0, message
        assert f"pipeline stage {fail_stage}" in message and "ForwardPass" in message, message
        assert "boom in a layer" in message, message


@pytest.mark.parametrize("save,load,zero", [((2, 4), (2, 4), 1), ((2, 4), (4, 8), 1), ((4, 8), (1, 2), 2),
                                            ((2, 4), (4, 8), 0)])
def test_checkpoint_resumes_on_any_stage_count(tmp_path, save, load, zero):
    """Saved with S stages, loaded into S' stages (same global batch): training continues exactly
    as without the interruption. Upstream's file layout: per-layer files, one model-states file per
    stage, optimizer partitions per stage and data-parallel rank."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(4, jobs.save_and_resume, *save, *load, zero, path, "save")
    files = saved[0][1]
    assert {f"layer_{i:02d}-model_states.pt" for i in range(8)} <= set(files), files
    assert {f"mp_rank_{s:02d}_model_states.pt" for s in range(save[0])} <= set(files), files
    if zero:
        dp = 4 // save[0]
        assert {f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(dp) for s in range(save[0])} \
            <= set(files), files
    resumed = run_distributed(4, jobs.save_and_resume, *save, *load, zero, path, "load")
    for (want, _), (got, _) in zip(saved, resumed):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("load", [(1, 2), (4, 8)])
def test_ds_to_universal_of_pipeline_checkpoint_resumes(tmp_path, load):
    """ds_to_universal reads every stage's files (it read stage 0's alone and wrote a universal
    checkpoint without the later stages' parameters); loaded with load_universal into another
    stage count, training continues exactly."""
    from deepspeed.checkpoint.ds_to_universal import convert

    path = str(tmp_path / "ckpt")
    saved = run_distributed(4, jobs.save_and_resume, 2, 4, *load, 1, path, "save")
    assert convert(f"{path}/ckpt", f"{path}/ckpt_universal") == 2 * 6 + 1   # 6 blocks, the tied embedding
    resumed = run_distributed(4, jobs.save_and_resume, 2, 4, *load, 1, path, "load", "fp32", "ckpt_universal")
    for (want, _), (got, _) in zip(saved, resumed):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("stages", [2, 4, 1])
def test_loads_upstream_pipeline_checkpoint(tmp_path, stages):
    """A checkpoint written by DeepSpeed 0.19.8's PipelineEngine (tests/fixtures/ds_0_19_8_pipe,
    made by tools/fixtures/gen_pipe_checkpoint.py) resumes in ours, into its own and other
    stage counts, to the losses upstream itself reached after resuming."""
    import os

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_pipe")
    results = run_distributed(4, jobs.resume_upstream, stages, fixture, str(tmp_path / "ckpt"))
    for got, want in results:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_monitor_writes_the_batch_loss_on_rank_0(tmp_path):
    """Rank 0 is the first stage: it writes Train/Samples/train_loss from the batch mean the last
    stage broadcasts (upstream's pipeline event), keyed by samples."""
    import csv

    micro, gas, steps = 2, 2, 3
    results = run_distributed(2, jobs.train, 2, micro, gas, 0, steps, 0, False, "fp32", 0.0, "parameters",
                              str(tmp_path), print_every=1)
    # the steps_per_print line on rank 0 (the first stage) shows the batch loss (it showed loss=nan)
    shown = [float(re.search(r"loss=([0-9.]+)", line).group(1)) for line in results[0][2]["progress"]]
    assert shown == pytest.approx(results[0][0], abs=1e-4), results[0][2]["progress"]
    with open(tmp_path / "pipe" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))[1:]
    assert [int(r[0]) for r in rows] == [micro * gas * (i + 1) for i in range(steps)]
    assert [float(r[1]) for r in rows] == pytest.approx(results[0][0], rel=1e-6)
