"""`offload_optimizer.device: "nvme"` on real gloo ranks and real files ([Note: optimizer state
swapping] in deepspeed/runtime/swap_tensor/optimizer_swapper.py): the same training as CPU offload,
bit for bit, and as plain PyTorch on the global batch, at ZeRO 1-3 and 1-2 ranks, with every master and
optimizer state tensor on disk between steps (files counted, in-memory tensors checked to be
placeholders); checkpoints resume on another world size and consolidate with zero_to_fp32; a write
cut short or a removed swap file raises on every rank, naming the path and the cause."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

import ckpt_jobs as J
from harness import run_distributed
from models import reference_training
from test_engine_dp import STEPS, _config, train_engine


def _nvme(config: dict, stage: int, path: str, device: str = "nvme") -> dict:
    cfg = copy.deepcopy(config)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": stage, "reduce_bucket_size": 300,
                                "offload_optimizer": {"device": device, "nvme_path": path}}
    cfg["aio"] = {"block_size": 8192, "intra_op_parallelism": 2}
    return cfg


def _swapped_job(config: dict, steps: int) -> dict:
    """Train; after every step record the bytes on disk, the bytes the state needs and whether any
    master or state tensor still holds memory (it must not: all of it lives in files)."""
    seen = []

    def inspect(engine, step):
        if step < 0:
            return
        opt = engine.optimizer
        swapper = opt.swapper
        shards = list(getattr(opt, "units", None) or opt.buckets)
        needed, resident = 0, []
        for shard in shards:
            tensors = [shard.master] + [v for m, _ in shard.fragment_masters
                                       for v in opt.optimizer.state.get(m, {}).values()
                                       if torch.is_tensor(v) and v.dim() > 0]
            needed += sum(t.numel() * t.element_size() for t in tensors)
            resident += [t.numel() for t in tensors if t.numel() > 1 and t.stride(0) != 0]
        seen.append({"on_disk": swapper.nbytes_on_disk(), "needed": needed, "resident": resident,
                     "sizes": sorted({s.master.numel() for s in shards}), "dir": swapper.dir.path})

    result = train_engine(config, steps, edit=inspect)
    result["seen"] = seen
    return result


@pytest.mark.parametrize("stage, world", [(3, 1), (3, 2), (2, 2), (1, 1)])
def test_nvme_equals_cpu_offload_and_plain_pytorch(tmp_path, stage, world):
    base = _config(micro=2, gas=2)
    nvme = run_distributed(world, _swapped_job, _nvme(base, stage, str(tmp_path)), STEPS)
    cpu = run_distributed(world, train_engine, _nvme(base, stage, str(tmp_path), "cpu"), STEPS)
    assert_equal_cpu_offload_and_reference(nvme, cpu, base, world)
    for rank_result in nvme:
        for seen in rank_result["seen"]:
            assert seen["resident"] == [], seen   # nothing of the masters and moments left in memory
            assert seen["on_disk"] >= seen["needed"] > 0, seen   # master + exp_avg + exp_avg_sq, in files
        assert min(rank_result["seen"][-1]["sizes"]) < 1024, "small pieces swapped too (no 1 MiB floor)"


def assert_equal_cpu_offload_and_reference(nvme: list, cpu: list, base: dict, world: int) -> None:
    """NVMe results equal CPU offload's bit for bit (the same order of operations) and plain
    PyTorch's on the same global batch (`base`: the config without offload) to 1e-6."""
    for a, b in zip(nvme, cpu):
        assert a["losses"] == b["losses"]
        for name in b["state"]:
            assert torch.equal(a["state"][name], b["state"][name]), name
    ref_losses, ref_state, _ = reference_training(base, STEPS, world)
    torch.testing.assert_close(torch.tensor(nvme[0]["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
    for name, ref in ref_state.items():
        torch.testing.assert_close(nvme[0]["state"][name], ref, rtol=1e-6, atol=1e-6, msg=name)


def _resume_config(world: int, path: str) -> dict:
    cfg = J.config(3, world)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    return cfg


def test_nvme_checkpoint_resumes_on_another_world_size_and_consolidates(tmp_path):
    check_resume_2_to_1_and_consolidate(tmp_path, _resume_config)


def _counted_job(method: str, job: Any, cfg: dict, path: str) -> dict:
    """`job(cfg, path)` (J.save_job / J.load_job), recording the swap buffers' peak in memory during
    `engine.<method>` and each shard's bytes (master + moments, as the swapper lays them out)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    seen: dict = {}
    original = getattr(DeepSpeedEngine, method)

    def counted(engine, *args, **kwargs):
        swapper = engine.optimizer.swapper
        swapper.peak_resident_bytes = swapper.resident_bytes
        out = original(engine, *args, **kwargs)
        seen["peak"] = swapper.peak_resident_bytes
        seen["shards"] = [layout[-1].offset + layout[-1].nbytes for layout in swapper._layouts]
        return out

    setattr(DeepSpeedEngine, method, counted)
    try:
        result = job(cfg, path)
    finally:
        setattr(DeepSpeedEngine, method, original)
    return {**result, "counted": seen}


def _trained_load_job(cfg: dict, load_dir: str) -> dict:
    """An engine that trained a step (its optimizer state on disk, to be replaced) loads, then trains
    the batches after the save point."""
    engine = J.build(cfg, seed=123)
    data = J.batches(6)
    J.train(engine, data[:1])
    engine.load_checkpoint(load_dir)
    snap = J.snapshot(engine)
    return {"snap": snap, "post_losses": J.train(engine, data[3:])}


def _assert_one_shard_at_a_time(counted: dict) -> None:
    shards = counted["shards"]
    assert len(shards) >= 3 and sum(shards) > 2 * max(shards), shards   # a bound that says something
    assert 0 < counted["peak"] <= -(-max(shards) // 4096) * 4096, counted


def test_nvme_checkpoint_streams_one_shard_at_a_time(tmp_path):
    """ZeRO-2 saved at 2 ranks (the re-cut's all-to-all path), loaded at 1 (into an engine that trained:
    its state on disk is replaced): load_checkpoint holds one sub-group's swap buffer at a time, not the
    rank's whole optimizer shard, save_checkpoint none (it reads the swap files), and the run resumes exactly."""
    def cfg(world: int) -> dict:
        c = J.config(2, world)
        c["zero_optimization"]["reduce_bucket_size"] = 64   # many sub-groups: the bound below says something
        c["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
        return c

    (tmp_path / "swap").mkdir()
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(2, _counted_job, "save_checkpoint", J.save_job, cfg(2), ckpt)
    for rank in saved:   # the save streams the swap files into the checkpoint: no swap buffer at all
        assert rank["counted"]["peak"] == 0, rank["counted"]   # (test_nvme_checkpoint_stream.py: the file)
    loaded = run_distributed(1, _counted_job, "load_checkpoint", _trained_load_job, cfg(1), ckpt)[0]
    _assert_one_shard_at_a_time(loaded["counted"])
    J.assert_snap_equal(saved[0]["snap"], loaded["snap"])
    torch.testing.assert_close(torch.tensor(loaded["post_losses"]), torch.tensor(saved[0]["post_losses"]),
                               rtol=1e-6, atol=1e-6)


def check_resume_2_to_1_and_consolidate(tmp_path, resume_config) -> None:
    """Saved at 2 ranks, resumed at 1 (`resume_config(world, swap_path)`), consolidated by
    zero_to_fp32 and loaded by a CPU-offload run: the NVMe checkpoint has the CPU-offload layout."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    saved = run_distributed(2, J.save_job, resume_config(2, str(swap)), str(ckpt))[0]
    loaded = run_distributed(1, J.load_job, resume_config(1, str(swap)), str(ckpt))[0]
    J.assert_snap_equal(saved["snap"], loaded["snap"])
    assert J._snap_equal(saved["snap"], saved["snap_after_save"])   # saving left the state as it was
    torch.testing.assert_close(torch.tensor(loaded["post_losses"]), torch.tensor(saved["post_losses"]),
                               rtol=1e-6, atol=1e-6)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    for name, entry in saved["snap"].items():
        assert torch.equal(consolidated[name], entry["fp32"]), name
    # the CPU-offload layout: a CPU-offload run loads the NVMe run's checkpoint as well
    cpu_cfg = J.config(3, 2, offload=True)
    cpu = run_distributed(2, J.load_job, cpu_cfg, str(ckpt))[0]
    J.assert_snap_equal(saved["snap"], cpu["snap"])


def fault_job(config: dict, fault: str, swapper: str = "optimizer") -> dict:
    """Two steps, then a fault on rank 1 only (a 4 KiB file-size limit: writes cut short as on a full
    device; or its swap files deleted), then a step: every rank must raise, none may hang."""
    import resource
    import signal

    import deepspeed
    import deepspeed.comm as dist

    from models import global_batches, make_model, micro_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=copy.deepcopy(config))
    swap_dir = (engine.optimizer if swapper == "optimizer" else engine._stage3).swapper.dir.path
    batches = list(global_batches(3, 2 * world))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    error = None
    try:
        for step, (x, y) in enumerate(batches):
            if step == 2 and rank == 1:
                if fault == "full":
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG, as ENOSPC on a full device
                    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))   # no write past 4 KiB
                else:
                    for name in os.listdir(swap_dir):
                        if name.endswith(".swp"):
                            os.remove(os.path.join(swap_dir, name))
            engine.backward(engine(micro_slice(x, 2, 0, rank, world), micro_slice(y, 2, 0, rank, world)))
            engine.step()
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
        engine.destroy()
    return {"error": error, "removed": not os.path.exists(swap_dir)}


@pytest.mark.parametrize("fault, cause", [("full", "File too large"), ("removed", "no such file")])
def test_swap_faults_raise_on_every_rank(tmp_path, fault, cause):
    config = _nvme(_config(micro=2, gas=1), 3, str(tmp_path))
    config["zero_optimization"]["reduce_bucket_size"] = 100   # several units: large files
    results = run_distributed(2, fault_job, config, fault)
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, r)
        assert r["removed"], r   # engine.destroy() removed the swap directory
        assert "offload_optimizer.device nvme" in r["error"] and "rank 1" in r["error"], r["error"]
        assert "ds_swap_optimizer_rank1_" in r["error"] and cause in r["error"], r["error"]


def test_leftovers_of_dead_runs_are_removed_and_nothing_else(tmp_path):
    import json
    import socket

    from deepspeed.runtime.swap_tensor.swap_files import OWNER_FILE, SwapDir

    dead = tmp_path / "ds_swap_optimizer_rank0_999999_deadbeef"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 12345}))
    (dead / "shard_00000.swp").write_bytes(b"0" * 10)
    live = tmp_path / "ds_swap_optimizer_rank0_live"
    live.mkdir()
    (live / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    stranger = tmp_path / "ds_swap_not_ours"   # no owner file: not a swap directory of ours
    stranger.mkdir()
    (tmp_path / "user_file.bin").write_bytes(b"keep")
    swap = SwapDir(str(tmp_path), "optimizer", 0)
    assert swap.leftovers == [str(dead)] and not dead.exists()
    assert live.exists() and stranger.exists() and (tmp_path / "user_file.bin").exists()
    swap.remove()
    assert not os.path.exists(swap.path)


def _modify_job(config: dict, steps: int) -> dict:
    """Training with a GatheredParameters(modifier_rank=0) write between steps: the unit's master
    must take it although it lives on disk (read in, changed, written back)."""
    import deepspeed

    def edit(engine, step):
        if step == 1:
            weight = next(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
                weight.data.mul_(0.5)

    return train_engine(config, steps, edit=edit)


def test_gathered_parameters_modifier_reaches_the_swapped_master(tmp_path):
    base = _config(micro=2, gas=1)
    nvme = run_distributed(1, _modify_job, _nvme(base, 3, str(tmp_path)), 4)[0]
    cpu = run_distributed(1, _modify_job, _nvme(base, 3, str(tmp_path), "cpu"), 4)[0]
    assert nvme["losses"] == cpu["losses"]
