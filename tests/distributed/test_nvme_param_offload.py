"""`offload_param.device: "nvme"` on real gloo ranks and real files ([Note: parameter swapping] in
deepspeed/runtime/swap_tensor/param_swapper.py): ZeRO-3 training with parameter shards in files, alone
and with the optimizer state on NVMe too, equals CPU offload bit for bit and plain PyTorch on the
global batch at 1 and 2 ranks; every shard's bytes are on disk and the shards in memory never exceed
`max_in_cpu`; the trace's read-ahead is used; checkpoints resume on another world size and
consolidate with zero_to_fp32; a removed swap file raises on every rank naming the path; a model built
under zero.Init(remote_device="nvme") trains the same."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import ckpt_jobs as J
from harness import run_distributed
from test_engine_dp import STEPS, _config, train_engine
from test_nvme_offload import assert_equal_cpu_offload_and_reference, check_resume_2_to_1_and_consolidate, fault_job

# max_in_cpu per world size: the largest unit's shard fits, the model's shards do not
# (1 rank: 1056 of 1732 elements; 2 ranks: 528 of 866)
MAX_IN_CPU = {1: 1100, 2: 600}


def _offload(config: dict, path: str, param: str = "nvme", optimizer: str = "cpu", world: int = 2) -> dict:
    cfg = copy.deepcopy(config)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": 3, "reduce_bucket_size": 300,
                                "param_persistence_threshold": 0, "prefetch_bucket_size": 600,
                                "offload_param": {"device": param, "nvme_path": path, "max_in_cpu": MAX_IN_CPU[world]},
                                "offload_optimizer": {"device": optimizer, "nvme_path": path}}
    cfg["aio"] = {"block_size": 8192, "intra_op_parallelism": 2}
    return cfg


class _BuiltUnderInit:
    """Builds TinyMLP under zero.Init(remote_device="nvme", config_dict_or_path=config), as Lightning
    does with offload_parameters=True and remote_device="nvme" (picklable for the ranks)."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def __call__(self) -> torch.nn.Module:
        import deepspeed
        from models import TinyMLP

        with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=self.config):
            model = TinyMLP()
        assert all(p.numel() == 0 for p in model.parameters())   # partitioned as it was built
        return model


def _swapped_job(config: dict, steps: int, under_init: bool = False) -> dict:
    """Train; after every step record the shard bytes in files and the shard elements in memory."""
    seen = []

    def inspect(engine, step):
        swapper = engine._stage3.swapper
        units = engine._stage3.units
        in_memory = sum(u.raw_shard.numel() for u in units if u.raw_shard.numel() and u.raw_shard.stride(0))
        seen.append({"on_disk": swapper.nbytes_on_disk(), "needed": sum(u.layout.shard_numel * 4 for u in units),
                     "in_memory": in_memory, "accounted": swapper.resident_numel(), "peak": swapper.peak_used,
                     "budget": swapper.budget, "hits": swapper.read_ahead_hits, "files": len(os.listdir(swapper.dir.path))})

    model_cls = _BuiltUnderInit(config) if under_init else None
    result = train_engine(config, steps, edit=inspect, **({"model_cls": model_cls} if under_init else {}))
    result["seen"] = seen
    return result


@pytest.mark.parametrize("world, optimizer, under_init", [(1, "cpu", True), (2, "nvme", False)])
def test_nvme_params_equal_cpu_offload_and_plain_pytorch(tmp_path, world, optimizer, under_init):
    """1 rank: the model built under zero.Init(remote_device="nvme"); 2 ranks: optimizer state on NVMe too."""
    base = _config(micro=2, gas=2)
    config = _offload(base, str(tmp_path), "nvme", optimizer, world)
    nvme = run_distributed(world, _swapped_job, config, STEPS, under_init)
    cpu = run_distributed(world, train_engine, _offload(base, str(tmp_path), "cpu", "cpu"), STEPS)
    assert_equal_cpu_offload_and_reference(nvme, cpu, base, world)
    for r in nvme:
        for seen in r["seen"]:
            assert seen["on_disk"] == seen["needed"] > 0, seen   # every shard's fp32 bytes in its file
            assert seen["in_memory"] <= seen["accounted"] <= seen["budget"], seen
            assert seen["peak"] <= seen["budget"], seen
        assert r["seen"][-1]["budget"] == MAX_IN_CPU[world] < r["seen"][-1]["needed"] // 4   # really swapping
        assert r["seen"][-1]["hits"] > 0, r["seen"][-1]   # reads ahead along the trace were used


def _resume_config(world: int, path: str) -> dict:
    cfg = J.config(3, world)
    cfg["zero_optimization"].update({"param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 500}})
    return cfg


def test_nvme_param_checkpoint_resumes_on_another_world_size_and_consolidates(tmp_path):
    check_resume_2_to_1_and_consolidate(tmp_path, _resume_config)


def test_removed_param_swap_file_raises_on_every_rank(tmp_path):
    config = _offload(_config(micro=2, gas=1), str(tmp_path))
    for rank, r in enumerate(run_distributed(2, fault_job, config, "removed", "param")):
        assert r["error"] is not None, (rank, r)
        assert r["removed"], r   # engine.destroy() removed the swap directory
        assert "offload_param.device nvme" in r["error"] and "rank 1" in r["error"], r["error"]
        assert "ds_swap_param_rank1_" in r["error"] and "no such file" in r["error"], r["error"]
