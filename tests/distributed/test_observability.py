"""Observability on real gloo processes (2 ranks): monitors write on rank 0 only; the breakdown shows
the ZeRO optimizer's step and all-gather; the comms logger's per-op counts and bytes equal
deepspeed.comm's counter and its bandwidths follow nccl-tests' factors; log_summary prints
upstream's table on rank 0 (and the straggler view); memory reports count model states by kind."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os

import pytest
import torch

from harness import run_distributed
from models import make_model

HAS_TB = importlib.util.find_spec("tensorboard") is not None


def _train(engine, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(2, 16, generator=g), torch.randint(0, 4, (2,), generator=g)
        engine.backward(engine(x, y))
        engine.step()


def monitored_run(root: str) -> dict:
    import deepspeed

    rank = deepspeed.comm.get_rank()
    out_dir = os.path.join(root, f"rank{rank}")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
           "wall_clock_breakdown": True, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
           "tensorboard": {"enabled": HAS_TB, "output_path": out_dir, "job_name": "tb"}}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
        _train(engine, 4)
        engine.monitor.write_events([("Custom/marker", float(rank), 1)])   # every rank calls; rank 0 writes
        engine.destroy()
    return {"exists": os.path.exists(out_dir), "files": sorted(os.listdir(os.path.join(out_dir, "csv")))
            if os.path.exists(out_dir) else [], "stdout": stdout.getvalue()}


def test_monitors_write_on_rank_0_only(tmp_path):
    r0, r1 = run_distributed(2, monitored_run, str(tmp_path))
    assert not r1["exists"] and r0["exists"]
    assert {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_grad_norm.csv",
            "Train_Samples_elapsed_time_ms_backward_allreduce.csv", "Custom_marker.csv"} <= set(r0["files"])
    rows = (tmp_path / "rank0" / "csv" / "Train_Samples_train_loss.csv").read_text().split()
    assert [r.split(",")[0] for r in rows] == ["step", "8", "16", "24", "32"]   # 2 ranks x 2 micro x 2 samples
    assert (tmp_path / "rank0" / "csv" / "Custom_marker.csv").read_text().split() == ["step,marker", "1,0.0"]
    breakdown = [line for line in r0["stdout"].splitlines() if "time (ms)" in line]
    assert len(breakdown) == 2 and not [line for line in r1["stdout"].splitlines() if "time (ms)" in line]
    for name in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "optimizer_step", "optimizer_allgather"):
        assert f"| {name}: " in breakdown[0], name
    if HAS_TB:
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "rank0" / "tb"))


def comms_run() -> dict:
    import deepspeed
    import deepspeed.comm as dist

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 600},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "comms_logger": {"enabled": True, "prof_all": True}}
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    dist.comms_counter.reset()
    dist.reset_log()
    try:
        _train(engine, 3)
        counted = dist.comms_counter.summary()
        logged = dist.comms_logger.get_raw_data()
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            summary = dist.log_summary(show_straggler=True, return_dict=True)
        after = dist.comms_logger.get_raw_data()
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
        engine.destroy()
    return {"counted": counted, "logged": logged, "summary": summary, "stdout": stdout.getvalue(),
            "after": after, "ops": dist.get_logged_comm_ops()}


UPSTREAM_HEADER = ("Comm. Op            Message Size        Count               Total Latency(ms)   Avg Latency(ms)     "
                   "tput_avg (Gbps)     busbw_avg (Gbps)    ")


def test_comms_logger_matches_the_counter_and_prints_upstreams_table():
    r0, r1 = run_distributed(2, comms_run)
    for r in (r0, r1):
        assert set(r["logged"]) == set(r["counted"]) >= {"reduce_scatter_tensor", "all_gather_into_tensor"}
        for op, sizes in r["logged"].items():
            assert sum(v[0] for v in sizes.values()) == r["counted"][op]["count"], op
            assert sum(size * v[0] for size, v in sizes.items()) == r["counted"][op]["bytes"], op
            factor = {"all_reduce": 1.0, "reduce_scatter_tensor": 0.5, "all_gather_into_tensor": 0.5}.get(op, 1.0)
            for size, (count, lats, algbw, busbw) in sizes.items():
                assert len(lats) == count and all(b == pytest.approx(a * factor) for a, b in zip(algbw, busbw))
                assert all(a == pytest.approx(size * 8 / 1e6 / lat) for a, lat in zip(algbw, lats) if lat > 0)
        assert r["after"] == r["logged"]   # the summary's own barriers and exchanges are not logged
        straggler = r["summary"]["straggler_analysis"]
        for op, sizes in straggler.items():
            for size, s in sizes.items():
                own = r["summary"]["summary"][op][size]
                assert s["count"] == own["count"] and s["total_comm_lat_ms"] <= own["total_latency_ms"] + 1e-9
    lines = r0["stdout"].splitlines()
    assert lines[0] == UPSTREAM_HEADER and "reduce_scatter_tensor" in lines and "Breakdown with straggler effect" in lines
    assert r1["stdout"] == ""
    assert r0["summary"]["metadata"]["world_size"] == 2 and r1["summary"]["metadata"]["rank"] == 1


def memory_run(stage: int) -> dict:
    import deepspeed
    from deepspeed.runtime.memory_report import model_state_bytes

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "memory_breakdown": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
        _train(engine, 2)
    states = model_state_bytes(engine)
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    engine.destroy()
    return {"stdout": stdout.getvalue(), "states": states, "numel": numel}


@pytest.mark.parametrize("stage", [1, 3])
def test_memory_breakdown_counts_model_states_by_kind(stage):
    r0, r1 = run_distributed(2, memory_run, stage)
    numel = r0["numel"]
    for r in (r0, r1):
        s = r["states"]
        if stage == 1:   # full fp32 parameters and gradient buckets; half the masters and states per rank
            assert 4 * numel <= s["parameters"] <= 4 * numel * 1.02 + 64
        else:            # ZeRO-3 (nothing persistent): the shards, no unit is gathered between steps
            assert 2 * numel <= s["parameters"] <= 2 * numel * 1.05 + 256
        assert 2 * numel <= s["masters"] <= 2 * numel * 1.05 + 64
        assert 2 * s["masters"] <= s["optimizer states"] <= 2 * s["masters"] + 256   # exp_avg, exp_avg_sq, steps
    printed = r0["stdout"]
    for point in ("before forward", "after forward", "before backward", "after backward", "before step",
                  "after step"):
        assert f"Engine {point}" in printed
    assert printed.count("Model states on this rank: parameters ") == 6   # the reported step only (2 of 2)
    assert "CPU Virtual Memory:  used = " in printed and "Model states" not in r1["stdout"]
