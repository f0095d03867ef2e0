"""A MoE-layout (EP x TP) tag is joined one parameter at a time ([Note: joining a MoE-layout tag per
parameter] in deepspeed/checkpoint/moe_join.py): ds_to_universal and the JoinedReader of a plain
load_checkpoint at another layout never hold two joined values at once (counted), and their anonymous
memory stays far below the tag's state (measured); the index refuses what the whole join refused.

The tag is synthetic, in the files' format (runtime/checkpoint/moe_io.py writes it; the distributed tests
test_ep_tp_checkpoint.py check real tags end to end): two tensor ranks x two data ranks, tensor-sliced
parameters (dim 0 and dim 1) and replicated ones, each rank's optimizer as named pieces."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref

import pytest
import torch

from deepspeed.checkpoint import moe_join
from deepspeed.checkpoint.files import CheckpointError, expert_file, model_file, optim_file, save_file
from deepspeed.checkpoint.moe_to_universal import JoinedReader, convert_moe
from deepspeed.utils.rss_peak import peak_anon_rise

FIELDS = ("fp32", "exp_avg", "exp_avg_sq")
TP, DP = 2, 2


def _params(rows: int) -> dict[str, tuple[tuple[int, int], int | None]]:
    """name -> (whole shape, tensor dim or None for replicated)."""
    out = {}
    for i in range(4):
        out[f"layers.{i}.col.weight"] = ((2 * rows, 256), 0)
        out[f"layers.{i}.row.weight"] = ((rows, 512), 1)
        out[f"layers.{i}.mlp.experts.w"] = ((2 * rows, 256), None)
        out[f"layers.{i}.norm.weight"] = ((rows, 4), None)
    return out


def write_tag(folder: str, rows: int = 512, step: int = 3, drop: str | None = None) -> dict:
    """The tag, and {field: {name: whole value}} it holds. `drop`: that parameter's last piece left out."""
    params = _params(rows)
    gen = torch.Generator().manual_seed(0)
    whole = {f: {n: torch.randn(shape, generator=gen) for n, (shape, _) in params.items()} for f in FIELDS}
    os.makedirs(folder)
    dims = {n: d for n, (_, d) in params.items() if d is not None}
    for t in range(TP):
        module = {n: (whole["fp32"][n].chunk(TP, d)[t] if d is not None else whole["fp32"][n]).bfloat16()
                  for n, (_, d) in params.items()}   # 16-bit weights, as a bf16 run's
        save_file({"module": module, "tp_partition_dims": dims, "mp_world_size": TP, "ds_version": "0.19.8"},
                  os.path.join(folder, model_file(t)))
        save_file({"w": torch.zeros(2)}, os.path.join(folder, expert_file(0, 0, t)))   # host: a test file
        for d in range(DP):
            pieces, shapes = [], {}
            for n, (_, dim) in params.items():
                values = {f: (whole[f][n].chunk(TP, dim)[t] if dim is not None else whole[f][n]).reshape(-1)
                          for f in FIELDS}
                size = values["fp32"].numel()
                shapes[n] = tuple(whole["fp32"][n].chunk(TP, dim)[t].shape) if dim is not None else tuple(
                    whole["fp32"][n].shape)
                lo, hi = d * size // DP, (d + 1) * size // DP
                if drop == n and t == TP - 1 and d == DP - 1:
                    continue
                pieces.append((n, lo, hi - lo, {f: v[lo:hi].clone() for f, v in values.items()}))
            state = {moe_join.PIECES: pieces, "shapes": shapes, "step": step, "param_groups": [{"lr": 1e-3}],
                     "loss_scaler": None}
            save_file({"optimizer_state_dict": state}, os.path.join(folder, optim_file(d, False, t)))
    return whole


@pytest.fixture(scope="module")
def tag(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("moe_join") / "t")
    return folder, write_tag(folder)


class _Alive:
    """Wraps MoEIndex.join: how many joined values are alive at most when one more is made, and how many
    joins of each (name, field) were made."""

    def __init__(self, monkeypatch) -> None:
        self.refs: list = []
        self.most, self.joins = 0, {}
        join = moe_join.MoEIndex.join

        def counted(index, name, field):   # (no cycles hold a join's result: refcounts free it at once)
            self.refs = [r for r in self.refs if r() is not None]
            value = join(index, name, field)
            self.refs.append(weakref.ref(value))
            self.most = max(self.most, len(self.refs))
            self.joins[(name, field)] = self.joins.get((name, field), 0) + 1
            return value

        monkeypatch.setattr(moe_join.MoEIndex, "join", counted)


def test_convert_joins_one_value_at_a_time(tag, tmp_path, monkeypatch) -> None:
    folder, whole = tag
    alive = _Alive(monkeypatch)
    assert convert_moe(folder, str(tmp_path / "u")) == len(whole["fp32"])
    assert alive.most == 1 and set(alive.joins.values()) == {1}
    assert len(alive.joins) == len(FIELDS) * len(whole["fp32"])
    for name in whole["fp32"]:
        for field in FIELDS:
            saved = torch.load(tmp_path / "u" / "zero" / name / f"{field}.pt", weights_only=False)
            assert torch.equal(saved["param"], whole[field][name]), (name, field)
    model = torch.load(tmp_path / "u" / model_file(), weights_only=False)
    assert torch.equal(model["module"]["layers.1.row.weight"], whole["fp32"]["layers.1.row.weight"].bfloat16())


def test_joined_reader_in_the_loaders_order(tag, monkeypatch) -> None:
    """As load_checkpoint asks (loader.py): has / check of every master, each parameter's optimizer fields
    in (TP-cut) parts, then the masters copied: one value alive, each joined once, the values exact."""
    folder, whole = tag
    alive = _Alive(monkeypatch)
    reader = JoinedReader(folder, "t")
    assert alive.joins == {}   # indexed only
    names = reader.param_names()
    assert sorted(names) == sorted(whole["fp32"]) and reader.fields() == ["exp_avg", "exp_avg_sq"]
    for name in names:
        assert reader.has(name)
        reader.check(name, "fp32", 0, whole["fp32"][name].numel())
    for name in names:
        half = whole["fp32"][name].numel() // 2
        for field in reader.fields():
            got = torch.cat([reader.read(name, field, 0, half), reader.read(name, field, half)])
            assert torch.equal(got, whole[field][name].reshape(-1)), (name, field)
    for name in names:
        out = torch.empty(whole["fp32"][name].numel())
        reader.read_into(out, name, "fp32")
        assert torch.equal(out, whole["fp32"][name].reshape(-1)), name
    assert alive.most == 1 and set(alive.joins.values()) == {1}
    assert len(alive.joins) == len(FIELDS) * len(names)


def test_anonymous_memory_far_below_the_state(tag, tmp_path) -> None:
    """The joined state is ~36 MiB (12 parameters of 1 MiB x 3 fields, 4 small ones); the largest value one
    join makes is 1 MiB. The whole-tag join (before moe_join) rose by more than the state."""
    folder, whole = tag
    state = sum(v.numel() * 4 for values in whole.values() for v in values.values())
    JoinedReader(folder, "t")   # first: the modules it imports (not measured)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)   # memory freed before is not reused unseen

    def load() -> None:
        reader = JoinedReader(folder, "t")
        for name in reader.param_names():
            for field in ["fp32", *reader.fields()]:
                reader.read(name, field)

    _, rise = peak_anon_rise(load)
    print(f"reader: anonymous rise {rise >> 20} MiB for {state >> 20} MiB of state")
    assert rise < state / 3, (rise, state)
    _, rise = peak_anon_rise(lambda: convert_moe(folder, str(tmp_path / "u")))
    print(f"convert: anonymous rise {rise >> 20} MiB for {state >> 20} MiB of state")   # (+ the 16-bit module)
    assert rise < state / 3, (rise, state)


@pytest.mark.parametrize("case,message", [
    ("incomplete", r"parameter 'layers.0.row.weight' \(tensor rank 1\) is incomplete in the optimizer files "
                   r"\(256 of 512 elements\)"),
    ("steps", r"the optimizer files record different steps \[3, 4\]"),
    ("foreign", r"hold no named pieces"),
])
def test_index_refuses(tmp_path, case: str, message: str) -> None:
    folder = str(tmp_path / "t")
    write_tag(folder, rows=2, drop="layers.0.row.weight" if case == "incomplete" else None)
    if case in ("steps", "foreign"):
        path = os.path.join(folder, optim_file(1, False, 1))
        state = torch.load(path, weights_only=False)
        if case == "steps":
            state["optimizer_state_dict"]["step"] = 4
        else:
            del state["optimizer_state_dict"][moe_join.PIECES]
        torch.save(state, path)
    with pytest.raises(CheckpointError, match=message):
        JoinedReader(folder, "t")
