"""3-D parallelism (pipeline x the user's tensor layers x data, ZeRO-1, clipping) equals one process
on the unsharded model: losses, the clipped global gradient norm (every element counted once:
tensor shards once each, replicated parameters once, pipeline stages once) and the final weights."""

from __future__ import annotations

import pytest
import torch

import pipe3d_jobs as jobs
from harness import run_distributed

_TP_SPLIT = {"col_weight": 0, "col_bias": 0, "row_weight": 1,   # the dim each tensor shard splits
             "up_proj.weight": 0, "up_proj.bias": 0, "down_proj.weight": 1}


def _check(results, steps, micro, gas, dp, clip, autotp=False, start=0, rtol=1e-5):
    want_losses, want_norms, want = jobs.reference(steps, micro, gas, dp, clip, autotp)
    seen = set()
    for losses, norms, params, meta in results:
        assert losses == pytest.approx(want_losses[start:], rel=rtol, abs=1e-6), meta
        assert norms == pytest.approx(want_norms[start:], rel=rtol), meta
        for name, value in params.items():
            full = want[name]
            dim = _TP_SPLIT.get(name.rsplit(".", 1)[-1], _TP_SPLIT.get(".".join(name.rsplit(".", 2)[-2:])))
            if dim is not None:
                full = full.chunk(meta["tp"], dim=dim)[meta["tp_rank"]]
            torch.testing.assert_close(value, full, rtol=rtol, atol=1e-6, msg=lambda m: f"{name} {meta}: {m}")
            seen.add(name)
    assert seen == set(want), set(want) - seen


@pytest.mark.parametrize("clip", [0.5])
def test_pipe_tensor_zero1_matches_one_process(clip):
    """2 stages x 2 tensor slices on 4 ranks; the norm was 1.36x the true one (replicated parameters
    counted once per tensor rank) and clipping scaled every step wrongly."""
    steps, micro, gas = 4, 2, 2
    results = run_distributed(4, jobs.train, 2, 2, micro, gas, 1, steps, clip)
    _check(results, steps, micro, gas, 1, clip)


@pytest.mark.parametrize("autotp", [False, True])
def test_pipe_tensor_resume_equals_uninterrupted(tmp_path, autotp):
    """Saved after 2 steps (a layer file per tensor slice: `layer_XX-model_YY-model_states.pt`),
    loaded into new engines, 2 more steps: equal to the uninterrupted run; zero_to_fp32 consolidates it
    (your tensor layers' slices joined along their tagged partition_dim, AutoTP's along its own record)."""
    steps, micro, gas = 4, 2, 2
    results = run_distributed(4, jobs.train, 2, 2, micro, gas, 1, steps, 0.5, str(tmp_path), 2, autotp=autotp)
    _check(results, steps, micro, gas, 1, 0.5, autotp=autotp)
    names = sorted(p.name for p in (tmp_path / "mid").iterdir())
    assert "layer_01-model_01-model_states.pt" in names, names
    from deepspeed.checkpoint import DeepSpeedCheckpoint

    # the inspection API reads the layout our writer records (checkpoint_parallel_dimensions)
    inspected = DeepSpeedCheckpoint(str(tmp_path / "mid"))
    assert (inspected.pp_degree, inspected.tp_degree, inspected.dp_degree, len(inspected.mp_rank_files)) == \
        (2, 2, 1, 4)
    assert inspected.model_state_metadata[0][1]["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 2}
    from deepspeed.checkpoint.ds_to_universal import convert

    # ds_to_universal joins every stage's tensor slices (it refused them before)
    assert convert(str(tmp_path / "mid"), str(tmp_path / "mid_universal")) > 0
    from deepspeed.utils.zero_to_fp32 import ZeroCheckpointError, get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="mid")   # the whole model at the save
    want = jobs.reference(2, micro, gas, 1, 0.5, autotp)[2]
    assert set(state) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        universal = tmp_path / "mid_universal" / "zero" / name / "fp32.pt"
        if universal.is_file():   # trained parameters (of every stage) whole
            torch.testing.assert_close(torch.load(universal, weights_only=False)["param"], value,
                                       rtol=1e-5, atol=1e-6, msg=name)
    assert {p.name for p in (tmp_path / "mid_universal" / "zero").iterdir() if p.is_dir()} == set(want)
    _check_maps(tmp_path / "mid" / "mp_rank_00_model_states.pt")
    if autotp:
        return
    # a slice tagged tensor_model_parallel without partition_dim: refused, not guessed
    first = tmp_path / "mid" / "mp_rank_00_model_states.pt"
    states = torch.load(first, weights_only=False)
    states["tensor_model_parallel_dims"]["1.col_weight"] = None
    torch.save(states, first)
    with pytest.raises(ZeroCheckpointError, match="'1.col_weight' is tagged tensor_model_parallel without"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="mid")
    from deepspeed.checkpoint.files import CheckpointError

    with pytest.raises(CheckpointError, match="1.col_weight"):
        convert(str(tmp_path / "mid"), str(tmp_path / "mid_universal2"))


@pytest.mark.slow
def test_pipe_tensor_data_2x2x2_matches_one_process():
    steps, micro, gas = 3, 2, 2
    results = run_distributed(8, jobs.train, 2, 2, micro, gas, 1, steps, 0.5)
    _check(results, steps, micro, gas, 2, 0.5)


@pytest.mark.parametrize("zero", [1, 3])
def test_megatron_tensor_layers_on_a_client_mpu_match_one_process(zero):
    """Megatron-DeepSpeed without pipeline parallelism: the user's tensor layers on a client `mpu`
    (tensor 2 x data 2 on 4 ranks) passed to `deepspeed.initialize(mpu=...)`, clipping on. Each tensor
    rank used to clip by its own partial norm (2.71 and 2.55 where the true norm is 3.00), and the
    tensor peers drifted apart from the third step ([Note: a client mpu's tensor layers])."""
    steps, micro = 3, 2
    results = run_distributed(4, jobs.train_mpu, 2, micro, zero, steps, 0.5)
    _check(results, steps, micro, 1, 2, 0.5)


def test_megatron_client_mpu_checkpoint_moves_tensor_size(tmp_path):
    """Megatron-style tensor layers on a client mpu, tensor 2 x data 2 (ZeRO-1, AdamW, clipping) saved after 2
    steps and resumed with a plain load_checkpoint at tensor 1 x data 2: the slices are joined along the
    partition dims the files record (before: a shape mismatch). The continued steps equal the one-process
    reference (losses, clipped norms, weights)."""
    steps, micro = 4, 2
    run_distributed(4, jobs.train_mpu, 2, micro, 1, steps, 0.5, str(tmp_path), 2)
    _check_maps(tmp_path / "mid" / "mp_rank_00_model_states.pt")
    from deepspeed.checkpoint import DeepSpeedCheckpoint

    inspected = DeepSpeedCheckpoint(str(tmp_path / "mid"))   # the client mpu's degrees, recorded
    assert (inspected.pp_degree, inspected.tp_degree, inspected.dp_degree) == (1, 2, 2)
    results = run_distributed(2, jobs.train_mpu, 1, micro, 1, steps, 0.5, str(tmp_path), None, 2)
    _check(results, steps, micro, 1, 2, 0.5, start=2, rtol=1e-6)


def _check_maps(path) -> None:
    """Every trained parameter of a saved TP=2 model-states file has its affine map: split on its recorded
    partition dim, else whole on each tensor rank."""
    from deepspeed.checkpoint.tp_maps import recorded_map, split_map

    states = torch.load(path, weights_only=False)
    dims = states.get("tensor_model_parallel_dims") or states.get("tp_partition_dims")
    for name, shape in ((n, s) for g in states["param_shapes"] for n, s in g.items()):
        full = [d * (2 if i == dims.get(name) else 1) for i, d in enumerate(shape)]
        assert recorded_map(states, name, 2) == split_map(full, dims.get(name), None, 2), name


@pytest.mark.parametrize("zero", [1])
def test_pipe_autotp_matches_one_process(zero):
    """AutoTP inside pipeline stages ([Note: AutoTP in pipeline stages]): plain blocks sharded by
    `tensor_parallel.autotp_size` over the grid's slice groups, 2 stages x 2 slices on 4 ranks."""
    steps, micro, gas = 3, 2, 2
    results = run_distributed(4, jobs.train, 2, 2, micro, gas, zero, steps, 0.5, autotp=True)
    assert any(v.shape != jobs.reference_model(True).state_dict()[n].shape for _, _, p, _ in results
               for n, v in p.items()), "no parameter was sharded"
    _check(results, steps, micro, gas, 1, 0.5, autotp=True)


def test_pipe_autotp_needs_model_axis():
    for message in run_distributed(2, jobs.autotp_without_model_axis):
        assert message is not None and "autotp_size=2" in message and "num_mp=2" in message, message


@pytest.mark.slow
def test_pipe_autotp_resume_data_2x2x2(tmp_path):
    """2 stages x 2 AutoTP slices x 2 replicas on 8 ranks, ZeRO-1, saved and resumed mid-run."""
    steps, micro, gas = 4, 2, 2
    results = run_distributed(8, jobs.train, 2, 2, micro, gas, 1, steps, 0.5, str(tmp_path), 2, autotp=True)
    _check(results, steps, micro, gas, 2, 0.5, autotp=True)


@pytest.mark.slow
def test_megatron_3d_example_matches_one_process(tmp_path):
    """examples/megatron_3d/train.py through the `deepspeed` launcher (4 ranks: 2 stages x 2 slices), its
    own --check against one process, as a user runs it."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(root)}
    run = subprocess.run([launcher, "--num_gpus", "4", os.path.join(root, "examples", "megatron_3d", "train.py"),
                          "--pp", "2", "--tp", "2", "--steps", "4", "--check"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "check against one process" in run.stdout, run.stdout[-3000:]


def _universal_into(tmp_path, autotp: bool, targets, drop: str | None = None, universal: bool = True) -> None:
    """2 stages x TP 2 trained 2 steps, saved, converted by ds_to_universal, then loaded with
    `load_universal` into each (stages, tensor size) target on stages x tensor ranks: the 2 continued steps
    equal the uninterrupted run (the one-process reference: losses, clipped norms, weights). `drop`:
    that optimizer field zeroed in every universal file first (the comparison must then fail).
    `universal=False`: the saved tag itself, loaded by a plain load_checkpoint."""
    from deepspeed.checkpoint.ds_to_universal import convert

    steps, micro, gas, clip = 4, 2, 2, 0.5
    run_distributed(4, jobs.train, 2, 2, micro, gas, 1, 3, clip, str(tmp_path), 2, autotp=autotp)
    if not universal:
        for pp, mp in targets:
            results = run_distributed(pp * mp, jobs.train, pp, mp, micro, gas, 1, steps, clip, str(tmp_path),
                                      autotp=autotp, universal="mid", start=2, load_universal=False)
            _check(results, steps, micro, gas, 1, clip, autotp=autotp, start=2, rtol=1e-6)
        return
    convert(str(tmp_path / "mid"), str(tmp_path / "mid_universal"))
    if drop is not None:
        for path in (tmp_path / "mid_universal" / "zero").glob(f"*/{drop}.pt"):
            record = torch.load(path, weights_only=False)
            torch.save(dict(record, param=torch.zeros_like(record["param"])), path)
    for pp, mp in targets:
        results = run_distributed(pp * mp, jobs.train, pp, mp, micro, gas, 1, steps, clip, str(tmp_path),
                                  autotp=autotp, universal="mid_universal", start=2)
        _check(results, steps, micro, gas, 1, clip, autotp=autotp, start=2, rtol=1e-6)


@pytest.mark.parametrize("autotp", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_universal_from_pipe_tensor_loads_into_other_layouts(tmp_path, autotp):
    """Pipeline x AutoTP (and pipeline x Megatron-style mpu layers): universal from 2 x 2, loaded into
    2 x 2, 1 stage x TP 2 and 2 stages x TP 1."""
    _universal_into(tmp_path, autotp, [(2, 2), (1, 2), (2, 1)])


def test_universal_from_pipe_tensor_sees_a_dropped_moment(tmp_path):
    """The comparison above sees the moments: exp_avg_sq zeroed in the universal files, the run differs."""
    with pytest.raises(AssertionError):
        _universal_into(tmp_path, True, [(1, 2)], drop="exp_avg_sq")


@pytest.mark.parametrize("autotp", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_plain_load_moves_pipe_tensor_checkpoints(tmp_path, autotp):
    """The same moves with a plain load_checkpoint of the 2 x 2 tag, no conversion ([Note: pipeline x tensor
    checkpoints at another layout]): into 1 stage x TP 2 each rank reads its own tensor rank's slices from
    both saved stages (before, every rank read tensor rank 0's and trained on without an error), into
    2 stages x TP 1 and 1 x TP 4 the saved slices are re-sliced (before: refused)."""
    _universal_into(tmp_path, autotp, [(1, 2), (2, 1), (1, 4)], universal=False)
