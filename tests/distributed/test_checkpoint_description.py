"""A checkpoint describes itself (issue 39): the files we save record their fragments, and a load plans from that.

On 2 gloo ranks, with two optimizer param groups that need padding (ckpt_desc_jobs.py), at ZeRO-1, 2, 3
and stage-0 bf16: each optimizer-state file's `ds_fragments` and the model-states `ds_layout` equal the
description derived from DeepSpeed's rule, and every recorded fragment is where the saved values are.
Then a load goes through the description: a file whose record disagrees with it is named (parameter,
file, both descriptions), and files re-laid at another alignment and parameter order, with `ds_layout`
saying so, load to the same state (a reader that derived the layout would misread them).
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import pytest
import torch

import ckpt_desc_jobs as D
import ckpt_jobs as J
from harness import run_distributed

from deepspeed.checkpoint import files
from deepspeed.checkpoint.description import FLAT, Description, recorded_fragments
from deepspeed.checkpoint.reader import CheckpointReader

CONFIGS = {"zero1": J.config(1, 2), "zero2": J.config(2, 2), "zero3": J.config(3, 2),
           "bf16_stage0": J.config(0, 2, "bf16")}
_SAVED: dict[str, tuple[str, dict]] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, rank 0's snapshot at save time) per config, saved once."""
    def get(name: str) -> tuple[str, dict]:
        if name not in _SAVED:
            where = str(tmp_path_factory.mktemp(name))
            _SAVED[name] = (where, run_distributed(2, D.save_job, CONFIGS[name], where)[0])
        return _SAVED[name]
    yield get
    _SAVED.clear()


def _files(tag: str) -> tuple[dict, list[dict]]:
    """(a model-states file, the optimizer-state files by rank) of `tag`."""
    model = sorted(glob.glob(os.path.join(tag, "*model_states.pt")))[0]
    optim = sorted(glob.glob(os.path.join(tag, "*zero_pp_rank_*_optim_states.pt")),
                   key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", p).group(1)))
    return files.load_file(model, mmap=False), [files.load_file(p, mmap=False) for p in optim]


def _flats(state: dict, field: str) -> list[torch.Tensor]:
    """A file's flats of `field` as the description numbers them (ZeRO-3: its groups joined)."""
    if "fp32_flat_groups" in state:
        values = state["fp32_flat_groups"] if field == "fp32" else \
            [s[field] for _, s in sorted(state["optimizer_state_dict"]["state"].items())]
        return [torch.cat([v.reshape(-1) for v in values])]
    if field == "fp32":
        return list(state["single_partition_of_fp32_groups"])
    return [s[field] for _, s in sorted(state["base_optimizer_state"]["state"].items())]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_saved_files_record_the_derived_description_and_it_is_true(saved, name):
    where, snap = saved(name)
    model, optim = _files(os.path.join(where, "global_step2"))
    derived = Description.derived(model["param_shapes"], len(optim), zero3=name == "zero3")
    assert len(optim) == 2 and len(derived.groups) == 2 and all(p.padding(1) for p in derived.partitions)
    assert Description.from_layout(model["ds_layout"], model["param_shapes"]) == derived
    for rank, file in enumerate(optim):
        state = file["optimizer_state_dict"]
        recorded = recorded_fragments(state["ds_fragments"], rank, f"rank {rank}")
        assert recorded == derived.fragments(rank) and recorded
        for field in ("fp32", "exp_avg", "exp_avg_sq"):
            flats = _flats(state, field)
            for f in recorded:
                got = flats[f.group if derived.kind == FLAT else 0][f.flat_offset:f.flat_offset + f.numel]
                want = snap[f.name][field].reshape(-1)[f.param_offset:f.param_offset + f.numel]
                assert torch.equal(got.float(), want.float()), (name, rank, field, f)


@pytest.mark.parametrize("edit", ["shifted", "permuted"])
def test_a_file_whose_record_disagrees_is_named(saved, tmp_path, edit):
    where, _ = saved("zero1")
    copy = str(tmp_path / "ckpt")
    shutil.copytree(where, copy)
    path = os.path.join(copy, "global_step2", J.optim_file(1))
    state = files.load_file(path, mmap=False)
    entries = state["optimizer_state_dict"]["ds_fragments"]["fragments"]
    name, group, flat, param, numel = entries[0]
    names = {repr(name), repr(entries[1][0])}
    if edit == "shifted":
        entries[0] = (name, group, flat + 2, param, numel)
    else:
        entries[0], entries[1] = entries[1], entries[0]
    torch.save(state, path)
    results = run_distributed(2, D.load_job, CONFIGS["zero1"], copy)
    assert all("error" in r for r in results), results
    named = [r["error"] for r in results if J.optim_file(1) in r["error"]]
    assert named and any(n in named[0] for n in names), results
    assert "ds_fragments" in named[0] and "alignment 2" in named[0] and "the file records" in named[0], results


def _relay(source_tag: str, target_tag: str, layout: dict) -> None:
    """Rewrite a ZeRO-1 tag's optimizer-state files in the layout `layout` describes (values read through
    the saved description), recording it: `ds_layout` in the model states, `ds_fragments` per file."""
    reader = CheckpointReader(os.path.dirname(source_tag), os.path.basename(source_tag))
    model_path = os.path.join(target_tag, J.MODEL_FILE)
    model = files.load_file(model_path, mmap=False)
    new = Description.from_layout(layout, model["param_shapes"])
    for rank in range(new.world_size):
        path = os.path.join(target_tag, J.optim_file(rank))
        state = files.load_file(path, mmap=False)
        inner = state["optimizer_state_dict"]
        for field in ("fp32", "exp_avg", "exp_avg_sq"):
            for g, partition in enumerate(new.partitions):
                flat = torch.zeros(partition.shard_numel)
                for f in new.fragments(rank):
                    if f.group == g:
                        flat[f.flat_offset:f.flat_offset + f.numel] = reader.read(f.name, field, f.param_offset,
                                                                                  f.numel)
                if field == "fp32":   # DeepSpeed's fp32 flats are saved without their end padding
                    inner["single_partition_of_fp32_groups"][g] = flat[:partition.shard_numel - partition.padding(rank)]
                else:
                    inner["base_optimizer_state"]["state"][g][field] = flat
        inner["group_paddings"] = [p.padding(rank) for p in new.partitions]
        inner["ds_fragments"] = new.record(rank)
        torch.save(state, path)
    model["ds_layout"] = new.layout()
    torch.save(model, model_path)


def test_a_load_plans_from_the_recorded_alignment_and_order(saved, tmp_path):
    where, snap = saved("zero1")
    copy = str(tmp_path / "ckpt")
    shutil.copytree(where, copy)
    tag = os.path.join(copy, "global_step2")
    layout = {**files.load_file(os.path.join(tag, J.MODEL_FILE))["ds_layout"], "alignment": 8}
    layout["groups"] = [list(reversed(g)) for g in layout["groups"]]
    _relay(os.path.join(where, "global_step2"), tag, layout)
    assert Description.from_layout(layout, files.load_file(os.path.join(tag, J.MODEL_FILE))["param_shapes"]) != \
        Description.derived(files.load_file(os.path.join(tag, J.MODEL_FILE))["param_shapes"], 2, zero3=False)
    loaded = run_distributed(2, D.load_job, CONFIGS["zero1"], copy)
    assert "snap" in loaded[0], loaded
    J.assert_snap_equal(snap, loaded[0]["snap"])
