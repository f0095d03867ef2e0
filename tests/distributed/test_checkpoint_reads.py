"""What a load reads (issue 39): each rank opens only the checkpoint files holding elements it loads.

Every checkpoint file goes through `files.load_file`; `files.watch_opens` records them per rank.
At ZeRO-3 and the same layout a rank's slices are exactly its own file's, so it opens the model-states
file, optimizer-state file and RNG file of its own rank, each once. At ZeRO-1/2 the file layout is
DeepSpeed's (one flat per param group in parameter order, cut in N shards), while this runtime's
shards follow its gradient buckets, so a rank's slices lie in a few saved ranks' files: it must open
exactly those (computed here from its slices and the file layout's arithmetic), at the same or another
world size. The loaded state is checked against the saving run's, so skipping a needed file fails too.
"""

from __future__ import annotations

import itertools
import os

import ckpt_jobs as J
import ckpt_reads_jobs as R
from harness import run_distributed


def test_same_layout_zero3_opens_only_its_own_files(tmp_path):
    saved = run_distributed(2, J.save_job, J.config(3, 2), str(tmp_path), pre=2, post=0)[0]
    loaded = run_distributed(2, R.opened_files_job, J.config(3, 2), str(tmp_path))
    for rank, result in enumerate(loaded):
        want = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", J.optim_file(rank), f"rng_state_{rank}.pt"]
        assert sorted(result["opened"]) == sorted(want), (rank, result["opened"])
    J.assert_snap_equal(saved["snap"], loaded[0]["snap"])


def _saved_ranks(groups: list[dict[str, int]], saved_world: int, pieces: list[tuple]) -> set[int]:
    """Saved ranks whose ZeRO-1/2 shards hold an element of `pieces` (DeepSpeed's layout: each group's
    parameters flattened in order, padded to a multiple of 2 x world, cut in equal shards)."""
    ranks = set()
    for g, name, start, numel in pieces:
        offsets = dict(zip(groups[g], itertools.accumulate(groups[g].values(), initial=0)))
        shard = -(-sum(groups[g].values()) // (2 * saved_world)) * 2
        lo, hi = offsets[name] + start, offsets[name] + start + numel
        ranks |= {k for k in range(saved_world) if max(lo, k * shard) < min(hi, (k + 1) * shard)}
    return ranks


def _one_bucket(world: int) -> dict:
    cfg = J.config(1, world)
    cfg["zero_optimization"].update(reduce_bucket_size=10**8, allgather_bucket_size=10**8)   # few files per rank
    return cfg


def test_zero1_opens_only_the_saved_ranks_holding_its_slices(tmp_path):
    saved = run_distributed(4, J.save_job, _one_bucket(4), str(tmp_path), pre=2, post=0)[0]
    groups = R.saved_groups(os.path.join(tmp_path, "global_step2"))
    for world in (4, 2):   # the same layout, then half the ranks
        loaded = run_distributed(world, R.opened_files_job, _one_bucket(world), str(tmp_path))
        counts = []
        for rank, result in enumerate(loaded):
            want = sorted(J.optim_file(k) for k in _saved_ranks(groups, 4, result["pieces"]))
            opened = [f for f in result["opened"] if f.endswith("_optim_states.pt")]
            assert sorted(opened) == want, (world, rank, result["opened"])
            assert [J.MODEL_FILE, f"rng_state_{rank}.pt"] == [f for f in result["opened"] if f not in opened]
            counts.append(len(opened))
        assert min(counts) < 4, f"every rank needed every file ({counts}): the test proves nothing"
        J.assert_snap_equal(saved["snap"], loaded[0]["snap"])
