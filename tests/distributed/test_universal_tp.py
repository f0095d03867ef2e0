"""`ds_to_universal` of AutoTP checkpoints: train at TP=2, save, convert (the tensor ranks' slices of the
fp32 masters and of every optimizer field joined along their partition dims, fused weights block by block),
then resume with `checkpoint.load_universal` at TP=1 and TP=2 in fresh processes; the continued training
equals the uninterrupted run at the target layout (fp32, ~1e-6). Same global batch throughout."""

from __future__ import annotations

import os

import pytest
import torch

from harness import run_distributed
from models import assert_params_close
from tp_engine_jobs import reference, train_tp

from deepspeed.checkpoint.ds_to_universal import convert

UNIVERSAL = {"checkpoint": {"load_universal": True}}


def _to_universal(tmp_path) -> str:
    out = str(tmp_path / "tp_universal")
    convert(str(tmp_path / "tp"), out)
    return out


@pytest.mark.parametrize("tp_to", [1, 2])
def test_sgd_momentum_tp2_universal(tmp_path, tp_to):
    """SGD with momentum (upstream's converter reads exp_avg unconditionally and fails on these): the
    momentum buffers are joined and re-cut; 2 steps at TP=2 ZeRO-1 + 1 resumed step = 3 uninterrupted."""
    ref = reference("glu", 3, dp=1, micro=2, lr=0.5, clip=0.0, momentum=0.9)
    run_distributed(2, train_tp, "glu", 2, 2, 1, micro=2, momentum=0.9, save_dir=str(tmp_path))
    out = _to_universal(tmp_path)
    params = [n for n in os.listdir(os.path.join(out, "zero")) if os.path.isdir(os.path.join(out, "zero", n))]
    assert params and all(sorted(os.listdir(os.path.join(out, "zero", n))) == ["fp32.pt", "momentum_buffer.pt", "step.pt"]
                          or sorted(os.listdir(os.path.join(out, "zero", n))) == ["fp32.pt", "momentum_buffer.pt"]
                          for n in params)
    got = run_distributed(2, train_tp, "glu", 1, tp_to, 1, micro=tp_to, momentum=0.9, load_dir=str(tmp_path),
                          start=2, extra=UNIVERSAL)
    assert_params_close(got, ref)


def _adamw(tmp_path, tp_to: int, stage_to: int, drop: str | None = None) -> tuple[list, dict]:
    want = run_distributed(2, train_tp, "glu", 3, tp_to, stage_to, micro=tp_to, lr=0.01, adam=True)
    run_distributed(2, train_tp, "glu", 2, 2, 2, micro=2, lr=0.01, adam=True, save_dir=str(tmp_path))
    out = _to_universal(tmp_path)
    if drop is not None:
        for name in os.listdir(os.path.join(out, "zero")):
            path = os.path.join(out, "zero", name, f"{drop}.pt")
            if os.path.isfile(path):   # as a converter that skipped the field would leave it: zeros
                record = torch.load(path, weights_only=False)
                torch.save(dict(record, param=torch.zeros_like(record["param"])), path)
    got = run_distributed(2, train_tp, "glu", 1, tp_to, stage_to, micro=tp_to, lr=0.01, adam=True,
                          load_dir=str(tmp_path), start=2, extra=UNIVERSAL)
    return got, want[0]


@pytest.mark.parametrize("tp_to,stage_to", [(1, 2), (2, 3)])
def test_adamw_tp2_universal(tmp_path, tp_to, stage_to):
    """AdamW, both moments and the step: TP=2 ZeRO-2 -> universal -> TP=1 ZeRO-2 / TP=2 ZeRO-3."""
    assert_params_close(*_adamw(tmp_path, tp_to, stage_to))


def test_dropped_moment_would_be_caught(tmp_path):
    """The comparison above sees the moments: the same universal checkpoint with exp_avg_sq zeroed differs."""
    got, want = _adamw(tmp_path, 1, 2, drop="exp_avg_sq")
    with pytest.raises(AssertionError):
        assert_params_close(got, want)


def test_universal_files_are_whole_and_upstream_shaped(tmp_path):
    """Each file holds the whole tensor under 'param' (a row/column weight also its 'cat_dim', as upstream's
    converter writes it); the model states say TP=1 and hold whole module weights. The saved TP=2 files
    record every parameter's affine map, and each map cuts exactly that tensor rank's module slice out of the
    whole weight (fused gate_up block by block, replicated norms whole)."""
    from deepspeed.checkpoint.tp_maps import recorded_map

    run_distributed(2, train_tp, "glu", 1, 2, 1, micro=2, momentum=0.9, save_dir=str(tmp_path))
    out = _to_universal(tmp_path)
    whole = run_distributed(2, train_tp, "glu", 0, 2, 1, micro=2, momentum=0.9, load_dir=str(tmp_path))[0]["params"]
    saved = [torch.load(tmp_path / "tp" / f"mp_rank_{m:02d}_model_states.pt", weights_only=False) for m in (0, 1)]
    assert saved[0]["universal_checkpoint_info"] == saved[1]["universal_checkpoint_info"]
    for name, value in whole.items():
        amap = recorded_map(saved[0], name, 2)
        for m in (0, 1):
            assert torch.equal(amap.extract(value, m), saved[m]["module"][name].float()), (name, m)
    states = torch.load(os.path.join(out, "mp_rank_00_model_states.pt"), weights_only=False)
    assert states["mp_world_size"] == 1 and not os.path.exists(os.path.join(out, "mp_rank_01_model_states.pt"))
    for name, value in whole.items():
        record = torch.load(os.path.join(out, "zero", name, "fp32.pt"), weights_only=False)
        torch.testing.assert_close(record["param"], value, rtol=0, atol=0)
        torch.testing.assert_close(states["module"][name], value, rtol=0, atol=0)


def test_zero3_tp2_converts_to_whole_weights(tmp_path):
    """AutoTP at ZeRO-3, whose model states hold empty module placeholders: the universal files hold the
    whole weights (the placeholders were once joined as slices and the conversion failed)."""
    run_distributed(2, train_tp, "glu", 1, 2, 3, micro=2, momentum=0.9, save_dir=str(tmp_path))
    out = _to_universal(tmp_path)
    whole = run_distributed(2, train_tp, "glu", 0, 2, 3, micro=2, momentum=0.9, load_dir=str(tmp_path))[0]["params"]
    for name, value in whole.items():
        record = torch.load(os.path.join(out, "zero", name, "fp32.pt"), weights_only=False)
        torch.testing.assert_close(record["param"], value, rtol=0, atol=0)


def test_deepspeed_pattern_description_converts_the_same(tmp_path):
    """DeepSpeed's own AutoTP checkpoints have no tp_partition_dims, only `universal_checkpoint_info` name
    patterns (row-parallel, replicated, fused sub-parameters): converted from those, the files are the same."""
    import re

    run_distributed(2, train_tp, "glu", 1, 2, 1, micro=2, momentum=0.9, save_dir=str(tmp_path))
    ours = _to_universal(tmp_path)
    for m in (0, 1):
        path = tmp_path / "tp" / f"mp_rank_{m:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        dims, blocks = states.pop("tp_partition_dims"), states.pop("tp_sub_param_sizes")
        names = [n for g in states["param_shapes"] for n in g]
        pattern = lambda n: f"^{re.escape(n)}$"   # noqa: E731
        states["universal_checkpoint_info"] = {
            "tp_replicated_parameter_patterns": [pattern(n) for n in names if n not in dims],
            "parameter_with_row_parallelism_patterns": [pattern(n) for n, d in dims.items() if d == 1],
            "parameter_with_sub_params": [{"patterns": [pattern(n)], "shape": [tuple(b), -1], "partition_dim": 0}
                                          for n, b in blocks.items()]}
        torch.save(states, path)
    theirs = str(tmp_path / "from_patterns")
    convert(str(tmp_path / "tp"), theirs)
    for name in os.listdir(os.path.join(ours, "zero")):
        for field in ("fp32.pt", "momentum_buffer.pt"):
            path = os.path.join(ours, "zero", name, field)
            if os.path.isfile(path):
                torch.testing.assert_close(torch.load(os.path.join(theirs, "zero", name, field))["param"],
                                           torch.load(path)["param"], rtol=0, atol=0)


def test_missing_moment_file_fails_at_load_on_every_rank(tmp_path):
    """One parameter's exp_avg_sq.pt deleted: load_checkpoint itself (no step taken) raises on both ranks,
    naming the parameter, the file and the files expected, instead of torch's KeyError at the next step."""
    from harness import DistributedTestError

    run_distributed(2, train_tp, "glu", 1, 2, 1, micro=2, lr=0.01, adam=True, save_dir=str(tmp_path))
    out = _to_universal(tmp_path)
    name = sorted(n for n in os.listdir(os.path.join(out, "zero")) if os.path.isdir(os.path.join(out, "zero", n)))[0]
    os.remove(os.path.join(out, "zero", name, "exp_avg_sq.pt"))
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(2, train_tp, "glu", 0, 1, 1, micro=1, lr=0.01, adam=True, load_dir=str(tmp_path),
                        extra=UNIVERSAL)
    text = str(caught.value)
    assert "failed on 2/2 ranks" in text, text
    for rank in (0, 1):
        message = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert f"parameter {name!r} has no exp_avg_sq.pt" in message and "exp_avg.pt, exp_avg_sq.pt" in message, \
            message
