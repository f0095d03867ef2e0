"""NVMe checkpoints stream ([Note: streamed checkpoint file] in deepspeed/checkpoint/stream_save.py):
the optimizer-states file written from the swap files chunk by chunk holds the same records, byte for
byte, as torch.save of today's in-memory re-cut (data.pkl included: same keys, dtypes, shapes, values),
resumes on another world size and stage like the uninterrupted run and consolidates with zero_to_fp32;
and save and load hold about one sub-group of optimizer state in memory, counted (peak anonymous RSS
over the call in a rank process, with a state of 200 MB)."""

from __future__ import annotations

import io
import os
import zipfile
from typing import Any

import pytest
import torch

import ckpt_jobs as J
from harness import run_distributed

from deepspeed.utils.rss_peak import peak_anon_rise


def _config(stage: int, world: int, path: str, bucket: int = 64) -> dict:
    cfg = J.config(stage, world)
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket   # several sub-groups
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    return cfg


def _records(source: Any) -> dict[str, bytes]:
    """{record name: bytes} of a torch.save file, without the archive prefix and the per-file id."""
    with zipfile.ZipFile(source) as archive:
        return {i.filename.split("/", 1)[1]: archive.read(i) for i in archive.infolist()
                if not i.filename.endswith(".data/serialization_id")}


def _streamed_save_job(cfg: dict, save_dir: str) -> dict:
    """Train, save (streamed), then torch.save today's in-memory re-cut of the same state and compare
    the two files record by record; then train on (the uninterrupted run)."""
    import deepspeed.comm as dist
    from deepspeed.checkpoint import files, stream_save
    from deepspeed.runtime.checkpoint import engine_io

    from deepspeed.runtime.checkpoint import stream_recut

    engine = J.build(cfg, "variety", seed=0)
    data = J.batches(6)
    J.train(engine, data[:3])
    snap = J.snapshot(engine)
    stream_save.peak_chunk_bytes = 0
    stream_recut.WINDOW = 5   # ZeRO-1/2 at 2 ranks: many windows, edges inside sent pieces
    try:
        engine.save_checkpoint(save_dir, tag="t")
    finally:
        stream_recut.WINDOW = None
    streamed = stream_save.peak_chunk_bytes > 0
    in_memory = engine._optimizer_partition_state()   # collective: the re-cut held in memory
    buffer = io.BytesIO()
    torch.save({"optimizer_state_dict": in_memory, "ds_config": engine.config,
                "ds_version": engine_io.state_version()}, buffer)
    rank = dist.get_rank()
    path = os.path.join(save_dir, "t", files.optim_file(rank, bf16=False))
    ours, today = _records(path), _records(io.BytesIO(buffer.getvalue()))
    differ = sorted(k for k in set(ours) | set(today) if ours.get(k) != today.get(k))
    loaded = torch.load(path, mmap=True, weights_only=False)["optimizer_state_dict"]
    post = J.train(engine, data[3:])
    return {"streamed": streamed, "differ": differ,
            "records": len(ours), "snap": snap, "post_losses": post,
            "fp32_groups": [t.numel() for t in loaded.get("fp32_flat_groups",
                                                          loaded.get("single_partition_of_fp32_groups", []))]}


@pytest.mark.parametrize("save, load", [((3, 2), (2, 1)), ((2, 1), (3, 2)), ((2, 2), (1, 1))])
def test_streamed_file_equals_in_memory_file_resumes_and_consolidates(tmp_path, save, load):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    (tmp_path / "swap").mkdir()
    swap, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    saved = run_distributed(save[1], _streamed_save_job, _config(save[0], save[1], swap), ckpt)
    for rank in saved:
        assert rank["streamed"], "the optimizer file was not streamed"
        assert rank["differ"] == [] and rank["records"] > 5, rank["differ"]   # every record, byte for byte
        assert sum(rank["fp32_groups"]) > 0
    loaded = run_distributed(load[1], J.load_job, _config(load[0], load[1], swap), ckpt, tag="t", model="variety")[0]
    J.assert_snap_equal(saved[0]["snap"], loaded["snap"])
    torch.testing.assert_close(torch.tensor(loaded["post_losses"]), torch.tensor(saved[0]["post_losses"]),
                               rtol=1e-6, atol=1e-6)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    for name, entry in saved[0]["snap"].items():
        assert torch.equal(consolidated[name], entry["fp32"]), name


# --- memory, counted ------------------------------------------------------------------------------
class _Big(torch.nn.Module):
    """4 x 2048^2 weights: 16.8 M parameters, 201 MB of fp32 masters + Adam moments."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.cross_entropy(x[:, :4], y)


def _memory_job(cfg: dict, save_dir: str) -> dict:
    """Peak anonymous RSS rise during save_checkpoint, and during load_checkpoint into an engine that
    trained a step (its swap buffers exist already, as in any run that saves or resumes)."""
    import deepspeed

    def engine_after_a_step(seed: int) -> Any:
        torch.manual_seed(seed)
        engine, *_ = deepspeed.initialize(model=_Big(), config=cfg)
        loss = engine(torch.randn(2, 2048), torch.tensor([0, 3]))
        engine.backward(loss)
        engine.step()
        return engine

    return save_and_load_peaks(engine_after_a_step, save_dir)


def save_and_load_peaks(engine_after_a_step: Any, save_dir: str) -> dict:
    """The sub-groups' sizes and the peak anonymous RSS rises of a save by engine_after_a_step(0) and a
    load into engine_after_a_step(1)."""
    import gc

    engine = engine_after_a_step(0)
    shards = [layout[-1].offset + layout[-1].nbytes for layout in engine.optimizer.swapper._layouts]
    gc.collect()
    _, save_peak = peak_anon_rise(lambda: engine.save_checkpoint(save_dir, tag="m"))
    engine.destroy()
    del engine
    gc.collect()
    other = engine_after_a_step(1)
    gc.collect()
    _, load_peak = peak_anon_rise(lambda: other.load_checkpoint(save_dir, tag="m"))
    other.destroy()
    return {"shards": shards, "save": save_peak, "load": load_peak}


@pytest.mark.slow
@pytest.mark.parametrize("stage, world", [(2, 1), (3, 1), (2, 2)])
def test_save_and_load_hold_about_one_sub_group(tmp_path, stage, world):
    """201 MB of optimizer state in 4 sub-groups of 50 MB (1 rank; at 2 ranks half of it per rank, and
    ZeRO-2's re-cut exchanges elements between the ranks): the rise of anonymous
    memory during save_checkpoint and load_checkpoint stays under one sub-group plus two 16 MiB
    chunks (the re-cut in memory, as before, needs the whole 201 MB)."""
    from deepspeed.checkpoint.stream_save import CHUNK_BYTES

    (tmp_path / "swap").mkdir()
    cfg = _config(stage, world, str(tmp_path / "swap"), bucket=2048 * 2048)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("scheduler", None)
    for got in run_distributed(world, _memory_job, cfg, str(tmp_path / "ckpt"), timeout=600):
        state, shard = sum(got["shards"]), max(got["shards"])
        assert state > 3 * shard and state > 190e6 / world, got   # a bound that says something
        bound = shard + 2 * CHUNK_BYTES
        print(f"ZeRO-{stage}, {world} rank(s): state {state / 1e6:.0f} MB per rank, largest sub-group "
              f"{shard / 1e6:.0f} MB, peak rise: save {got['save'] / 1e6:.0f} MB, load {got['load'] / 1e6:.0f} MB")
        assert got["save"] < bound, got
        assert got["load"] < bound, got


def _lost_swap_file_save_job(cfg: dict, save_dir: str) -> dict:
    """Rank 1's swap files vanish before a save: the save must raise on every rank (none may hang in the
    re-cut's exchange), naming the missing file, and publish nothing."""
    import glob

    import deepspeed.comm as dist

    engine = J.build(cfg, "variety", seed=0)
    J.train(engine, J.batches(1))
    if dist.get_rank() == 1:
        for path in glob.glob(os.path.join(engine.optimizer.swapper.dir.path, "shard_*.swp")):
            os.remove(path)
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except Exception as error:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


@pytest.mark.parametrize("stage", [2, 3])
def test_lost_swap_file_raises_on_every_rank(tmp_path, stage):
    (tmp_path / "swap").mkdir()
    ckpt = tmp_path / "ckpt"
    results = run_distributed(2, _lost_swap_file_save_job, _config(stage, 2, str(tmp_path / "swap")), str(ckpt))
    for result in results:
        assert result["error"] is not None and "shard_" in result["error"] and "rank 1" in result["error"], result
    assert not (ckpt / "t").exists() and not (ckpt / "latest").exists()


def _bytes_written_job(cfg: dict, save_dir: str) -> dict:
    """Bytes this rank process caused to be written to storage during save_checkpoint (/proc/self/io
    write_bytes: counted when pages are dirtied, whatever the file, deleted ones included) against
    the sizes of the files it wrote into the tag."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint import files

    def write_bytes() -> int:
        with open("/proc/self/io") as io_stats:
            return next(int(line.split()[1]) for line in io_stats if line.startswith("write_bytes:"))

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_Big(512), config=cfg)
    engine.backward(engine(torch.randn(2, 512), torch.tensor([0, 3])))
    engine.step()
    before = write_bytes()
    engine.save_checkpoint(save_dir, tag="b")
    written = write_bytes() - before
    rank = dist.get_rank()
    tag = os.path.join(save_dir, "b")
    mine = [files.optim_file(rank, bf16=False), f"rng_state_{rank}.pt"]
    mine += [os.path.join("..", n) for n in (files.LATEST, "zero_to_fp32.py")] + [files.model_file()] if rank == 0 else []
    engine.destroy()
    return {"written": written, "files": sum(os.path.getsize(os.path.join(tag, n)) for n in mine),
            "optim": os.path.getsize(os.path.join(tag, mine[0]))}


def test_multi_rank_save_writes_each_byte_once(tmp_path):
    """ZeRO-2 at 2 ranks (the re-cut exchanges elements between the ranks): the optimizer file is
    written while the exchange runs, so the bytes a rank writes are its files' sizes (a spill file
    written first, then copied into the file, doubled the optimizer file's bytes)."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io (Linux)")
    (tmp_path / "swap").mkdir()
    cfg = _config(2, 2, str(tmp_path / "swap"), bucket=512 * 512)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("scheduler", None)
    for got in run_distributed(2, _bytes_written_job, cfg, str(tmp_path / "ckpt")):
        print(f"ZeRO-2 NVMe, 2 ranks: wrote {got['written']:,} bytes for {got['files']:,} bytes of files "
              f"(optimizer file {got['optim']:,})")
        assert got["optim"] > 4e6, got   # the optimizer file dominates what a rank writes
        assert got["files"] - (1 << 20) < got["written"] < got["files"] + (1 << 20), got


def _async_save_job(cfg: dict, save_dir: str) -> dict:
    """checkpoint.async_save with NVMe optimizer state: save, then train on at once while the writer
    thread is held back until those steps rewrote every swap file ([Note: swap files under a background
    save]); the file must still be the state at the save, byte for byte."""
    import threading

    from deepspeed.checkpoint import files
    from deepspeed.runtime.checkpoint import engine_io

    engine = J.build(cfg, "variety", seed=0)
    data = J.batches(6)
    J.train(engine, data[:3])
    snap = J.snapshot(engine)
    buffer = io.BytesIO()
    torch.save({"optimizer_state_dict": engine._optimizer_partition_state(), "ds_config": engine.config,
                "ds_version": engine_io.state_version()}, buffer)
    go, real = threading.Event(), files._write

    def held_back(fd: int, data: Any) -> int:   # the writer thread waits for the steps below (10 s at most)
        if not go.is_set() and threading.current_thread() is not threading.main_thread():
            go.wait(10)
            go.set()
        return real(fd, data)

    swap_dir = engine.optimizer.swapper.dir.path
    files._write = held_back
    try:
        engine.save_checkpoint(save_dir, tag="t")
        pending = engine._checkpoint_slot.current
        background = pending is not None and pending.target == pending.job.run_background
        staged = os.path.join(files.staging_dir(save_dir, "t"), files.optim_file(J._dist().get_rank(), bf16=False))
        before_return = os.path.exists(staged + ".tmp") and os.path.getsize(staged + ".tmp") > 0
        post = J.train(engine, data[3:])
        aside = [n for n in os.listdir(swap_dir) if n.endswith(".saving")]
        go.set()
        engine.wait_for_checkpoint()
    finally:
        go.set()
        files._write = real
    import deepspeed.comm as dist

    path = os.path.join(save_dir, "t", files.optim_file(dist.get_rank(), bf16=False))
    ours, today = _records(path), _records(io.BytesIO(buffer.getvalue()))
    return {"background": background, "before_return": before_return, "aside": len(aside), "left": [n for n in os.listdir(swap_dir)
                                                                    if n.endswith(".saving")],
            "differ": sorted(k for k in set(ours) | set(today) if ours.get(k) != today.get(k)),
            "snap": snap, "post_losses": post}


@pytest.mark.parametrize("stage, world, background", [(3, 2, True), (2, 1, True), (2, 2, False)])
def test_async_save_streams_in_the_background(tmp_path, stage, world, background):
    """ZeRO-3 (2 ranks) and ZeRO-2 (1 rank): save_checkpoint returns before the optimizer file is written,
    the next steps rewrite the swap files (the saved ones renamed aside, removed once written), and the
    file is the state at the save (byte-identical to torch.save of the in-memory re-cut; resumes like the
    uninterrupted run). ZeRO-2 at 2 ranks writes it during the re-cut's exchange, before the call returns
    (the other files, and the rename, still in the background)."""
    (tmp_path / "swap").mkdir()
    swap, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    cfg = _config(stage, world, swap)
    cfg["checkpoint"] = {"async_save": True}
    saved = run_distributed(world, _async_save_job, cfg, ckpt)
    for rank in saved:
        assert rank["background"] and rank["before_return"] != background, rank
        assert rank["differ"] == [], rank["differ"]
        assert rank["left"] == [] and (rank["aside"] > 0) == background, rank
    loaded = run_distributed(world, J.load_job, _config(stage, world, swap), ckpt, tag="t", model="variety")[0]
    J.assert_snap_equal(saved[0]["snap"], loaded["snap"])
    torch.testing.assert_close(torch.tensor(loaded["post_losses"]), torch.tensor(saved[0]["post_losses"]),
                               rtol=1e-6, atol=1e-6)
