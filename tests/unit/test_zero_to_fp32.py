"""deepspeed/utils/zero_to_fp32.py: consolidation of ZeRO checkpoints into a full fp32 state dict.

(a) DeepSpeed-0.19.8-written fixtures (tests/fixtures/ds_0_19_8/stage{1,2,3}_{fp32,bf16}): our result
    must equal ``consolidated_fp32.pt``, DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
    output, key for key, bit for bit (fixtures not generated yet are skipped).
(b) Synthetic checkpoints written here from the documented DeepSpeed layout (stage 1/2 flat groups
    with per-parameter alignment padding and end-of-group padding cut into per-rank partitions;
    stage 3 per-parameter partitions across sub-groups), with garbage in every padding slot so an
    offset error shows up as a wrong value.
(c) Error cases, the command line, sharding/index files, safetensors, and the streaming property
    (at most one materialized parameter alive while writing).

The module is imported from its file, as a standalone script (it must not import deepspeed).
"""

import ast
import enum
import glob
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import weakref
from collections import OrderedDict

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "deepspeed", "utils", "zero_to_fp32.py")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "ds_0_19_8")
GARBAGE = 1.0e30  # written into every padding slot of the synthetic checkpoints


def _import_standalone():
    spec = importlib.util.spec_from_file_location("zero_to_fp32_standalone", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


z2f = _import_standalone()


def assert_same_state(got, want, *, check_dtype=True, check_order=True):
    assert (list(got) if check_order else sorted(got)) == (list(want) if check_order else sorted(want))
    for k in want:
        g, w = got[k], want[k]
        assert tuple(g.shape) == tuple(w.shape), k
        if check_dtype:
            assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        assert torch.equal(g.to(w.dtype), w), k


def as_fp32(state):
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def load_output(output_dir, safe=False):
    """Reassemble a converted output folder (sharded or not) into one dict, checking the index."""
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    index = os.path.join(output_dir, weights + ".index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        files = sorted(set(idx["weight_map"].values()))
        assert set(os.listdir(output_dir)) == set(files) | {os.path.basename(index)}
    else:
        idx, files = None, [weights]
    out = {}
    for name in files:
        part = read_safetensors(os.path.join(output_dir, name)) if safe else torch.load(
            os.path.join(output_dir, name), weights_only=True)
        if idx is not None:
            assert sorted(part) == sorted(k for k, v in idx["weight_map"].items() if v == name)
        assert not set(part) & set(out)
        out.update(part)
    if idx is not None:
        assert idx["metadata"]["total_size"] <= sum(v.numel() * v.element_size() for v in out.values())
    return out, idx


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def read_safetensors(path):
    """A reader written from the safetensors spec, independent of the writer under test."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    assert meta == {"format": "pt"}
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    pos = 0
    for a, b in spans:  # contiguous, no holes, covers the whole buffer
        assert a == pos
        pos = b
    assert pos == len(data)
    out = {}
    for name, v in header.items():
        a, b = v["data_offsets"]
        dtype = _ST_DTYPES[v["dtype"]]
        raw = torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(v["shape"]).clone()
    return out


# =============================================================================== synthetic layout


class FakeZeroStage(enum.IntEnum):  # stands for deepspeed.runtime.zero.config.ZeroStageEnum
    optimizer_states = 1
    gradients = 2
    weights = 3


class FakeLossScaler:  # stands for deepspeed.runtime.fp16.loss_scaler.LossScaler

    def __init__(self):
        self.cur_scale = 1.0
        self.dynamic = False


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g)


def make_params(spec, seed=0):
    return OrderedDict((name, _rand(*shape, seed=seed + i)) for i, (name, shape) in enumerate(spec))


def _save_common(ckpt_dir, tag, model_files, optim_files, latest=True):
    d = os.path.join(ckpt_dir, tag)
    os.makedirs(d, exist_ok=True)
    for name, obj in list(model_files.items()) + list(optim_files.items()):
        torch.save(obj, os.path.join(d, name))
    if latest:
        with open(os.path.join(ckpt_dir, "latest"), "w") as f:
            f.write(tag)
    return d


def write_stage12(ckpt_dir, world, groups, *, stage=2, frozen=None, buffers=None, shared=None, bf16=False,
                  param_align=0, nccl_align=2, tag="global_step7", latest=True):
    """A stage-1/2 checkpoint laid out as DeepSpeed 0.19.8 saves it.

    Per group: parameters flattened in order, each but the last followed by
    ``(-offset) % param_align`` filler elements (param_alignment_paddings), the group padded at the
    end to a multiple of ``nccl_align * world``, cut into ``world`` equal partitions; rank r saves
    its partition minus the end padding inside it (group_paddings[r]).
    Returns the state dict a correct consolidation must produce.
    """
    frozen = frozen or OrderedDict()
    buffers = buffers or OrderedDict()
    shared = shared or {}
    saved = [[] for _ in range(world)]
    group_pads = [[] for _ in range(world)]
    align_pads = []
    for params in groups:
        chunks, pads, cur = [], [], 0
        names = list(params)
        for i, name in enumerate(names):
            t = params[name].reshape(-1)
            chunks.append(t)
            cur += t.numel()
            pad = 0 if (i == len(names) - 1 or not param_align) else (-cur) % param_align
            pads.append(pad)
            chunks.append(torch.full((pad, ), GARBAGE))
            cur += pad
        used = cur
        align = nccl_align * world
        total = math.ceil(used / align) * align
        chunks.append(torch.full((total - used, ), GARBAGE))
        flat = torch.cat(chunks)
        part = total // world
        for r in range(world):
            lo = r * part
            keep = max(0, min(lo + part, used) - lo)
            saved[r].append(flat[lo:lo + keep].clone().requires_grad_(True))
            group_pads[r].append(part - keep)
        align_pads.append(pads)
    dtype = torch.bfloat16 if bf16 else torch.float32
    module = OrderedDict()
    module.update((k, v.clone()) for k, v in buffers.items())
    for params in groups:
        module.update((k, v.to(dtype)) for k, v in params.items())
    module.update((k, v.to(dtype)) for k, v in frozen.items())
    model_state = dict(
        module=module, buffer_names=list(buffers), optimizer=None,
        param_shapes=[OrderedDict((k, v.shape) for k, v in params.items()) for params in groups],
        frozen_param_shapes=OrderedDict((k, v.shape) for k, v in frozen.items()) if stage == 2 else None,
        shared_params=dict(shared),
        frozen_param_fragments=OrderedDict((k, v.to(dtype)) for k, v in frozen.items()) if stage == 2 else None,
        lr_scheduler=None, global_steps=7, dp_world_size=world, mp_world_size=1,
        ds_config={"zero_optimization": {"stage": stage}}, ds_version="0.19.8")
    prefix = "bf16_" if bf16 else ""
    optim = {}
    for r in range(world):
        osd = dict(
            loss_scaler=FakeLossScaler(), dynamic_loss_scale=False, overflow=False, clip_grad=1.0,
            base_optimizer_state=[{"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t), "step": 7}
                                  for t in saved[r]],
            single_partition_of_fp32_groups=saved[r],
            zero_stage=FakeZeroStage(stage), group_paddings=group_pads[r], param_alignment_paddings=align_pads,
            partition_count=[world] * len(groups), ds_version="0.19.8")
        optim[f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = dict(
            optimizer_state_dict=osd, ds_config={"zero_optimization": {"stage": stage}}, ds_version="0.19.8")
    d = _save_common(ckpt_dir, tag, {"mp_rank_00_model_states.pt": model_state}, optim, latest)
    expected = OrderedDict((k, v.float() if v.is_floating_point() else v) for k, v in buffers.items())
    if stage == 2:
        expected.update((k, v.to(dtype)) for k, v in frozen.items())
    for params in groups:
        expected.update(params)
    for alias, target in shared.items():
        if target in expected:
            expected[alias] = expected[target]
    return d, expected


def write_stage3(ckpt_dir, world, params, *, subgroup_sizes, frozen=None, buffers=None, shared=None, bf16=False,
                 tag="global_step7"):
    """A stage-3 checkpoint: each parameter padded to a multiple of ``world`` and cut into partitions of
    ceil(numel / world); rank r's flat is partition r of every parameter in order, split into sub-groups
    of ``subgroup_sizes`` parameters (fp32_flat_groups); frozen parameters likewise, per rank, in
    frozen_param_fragments of zero_pp_rank_<r>_mp_rank_00_model_states.pt."""
    frozen = frozen or OrderedDict()
    buffers = buffers or OrderedDict()
    shared = shared or {}
    assert sum(subgroup_sizes) == len(params)

    def partitions(t):
        n = t.numel()
        part = math.ceil(n / world)
        padded = torch.cat([t.reshape(-1), torch.full((part * world - n, ), GARBAGE, dtype=t.dtype)])
        return [padded[r * part:(r + 1) * part] for r in range(world)]

    names = list(params)
    per_rank_flats = [[] for _ in range(world)]
    start = 0
    for size in subgroup_sizes:
        chunk = names[start:start + size]
        start += size
        parts = [partitions(params[n]) for n in chunk]
        for r in range(world):
            per_rank_flats[r].append(torch.cat([p[r] for p in parts]) if parts else torch.empty(0))
    dtype = torch.bfloat16 if bf16 else torch.float32
    frozen_parts = OrderedDict((k, partitions(v.to(dtype))) for k, v in frozen.items())
    model, optim = {}, {}
    for r in range(world):
        module = OrderedDict((k, v.clone()) for k, v in buffers.items())
        module.update((k, torch.empty(0, dtype=dtype)) for k in list(params) + list(frozen))
        model[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = dict(
            module=module, buffer_names=list(buffers), optimizer=None,
            # one param group in param_shapes, two sub-groups in the flats: the reader must not mix them up
            param_shapes=[OrderedDict((k, v.shape) for k, v in params.items())],
            frozen_param_shapes=OrderedDict((k, v.shape) for k, v in frozen.items()),
            shared_params=dict(shared),
            frozen_param_fragments=OrderedDict((k, p[r].clone()) for k, p in frozen_parts.items()),
            dp_world_size=world, mp_world_size=1, ds_version="0.19.8")
        flats = [f.clone() for f in per_rank_flats[r]]
        osd = dict(zero_stage=FakeZeroStage.weights, loss_scaler=FakeLossScaler(), dynamic_loss_scale=False,
                   overflow=False, partition_count=world,
                   optimizer_state_dict={"state": {i: {"exp_avg": torch.zeros_like(f)} for i, f in enumerate(flats)},
                                         "param_groups": [{"lr": 0.1, "params": list(range(len(flats)))}]},
                   fp32_flat_groups=flats)
        optim[f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = dict(
            optimizer_state_dict=osd, ds_config={}, ds_version="0.19.8")
    d = _save_common(ckpt_dir, tag, model, optim)
    expected = OrderedDict((k, v.float() if v.is_floating_point() else v) for k, v in buffers.items())
    expected.update((k, v.to(dtype)) for k, v in frozen.items())
    expected.update(params)
    for alias, target in shared.items():
        if target in expected:
            expected[alias] = expected[target]
    return d, expected


STAGE12_GROUPS = [
    [("embed.weight", (11, 7)), ("ln.weight", (7, )), ("ln.bias", (7, )), ("head.bias", (5, ))],
    [("out.weight", (5, 3)), ("scalar", ())],
]


def _buffers():
    return OrderedDict([("running", torch.linspace(0, 1, 6).to(torch.bfloat16)), ("steps", torch.arange(3))])


# =============================================================================== (b) synthetic round trips


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("param_align,bf16", [(0, False), (8, True)])
def test_stage2_round_trip(tmp_path, world, param_align, bf16):
    groups = [make_params(spec, seed=10 * g) for g, spec in enumerate(STAGE12_GROUPS)]
    frozen = OrderedDict([("frozen.w", _rand(3, 3, seed=99))])
    _, want = write_stage12(tmp_path, world, groups, frozen=frozen, buffers=_buffers(), bf16=bf16,
                            shared={"tied.weight": "embed.weight"}, param_align=param_align)
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert_same_state(got, want)
    assert got["tied.weight"] is got["embed.weight"]
    assert not any(v.requires_grad for v in got.values())
    assert list(got)[:3] == ["running", "steps", "frozen.w"]  # buffers, frozen, trainable, aliases
    no_frozen = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    assert "frozen.w" not in no_frozen and len(no_frozen) == len(want) - 1


def test_stage1_has_no_frozen_entries(tmp_path):
    # stage 1 saves no frozen_param_shapes (DeepSpeed only does for partition_gradients); neither do we invent them
    groups = [make_params(STAGE12_GROUPS[0], seed=3)]
    _, want = write_stage12(tmp_path, 2, groups, stage=1, frozen=OrderedDict(f=torch.ones(2)))
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert_same_state(got, want)
    assert "f" not in got


@pytest.mark.parametrize("world,subgroups", [(1, [3, 2]), (2, [2, 3]), (3, [5, 0]), (4, [1, 4])])
def test_stage3_round_trip(tmp_path, world, subgroups):
    params = make_params([("a.weight", (5, 3)), ("a.bias", (5, )), ("b", (7, )), ("c.weight", (2, 2, 3)),
                          ("d", (1, ))], seed=5)
    frozen = OrderedDict([("emb.frozen", _rand(3, 5, seed=77)), ("tiny", _rand(1, seed=78))])
    _, want = write_stage3(tmp_path, world, params, subgroup_sizes=subgroups, frozen=frozen, buffers=_buffers(),
                           shared={"tied": "c.weight"}, bf16=world % 2 == 0)
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert_same_state(got, want)
    assert got["tied"] is got["c.weight"]
    lazy = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), lazy_mode=True)
    assert list(lazy) == list(want)
    assert lazy["tied"] is lazy["c.weight"]
    for k, v in lazy.items():
        assert not torch.is_tensor(v) and tuple(v.shape) == tuple(want[k].shape) and v.dtype == want[k].dtype
        assert torch.equal(v.contiguous(), want[k])


def test_tag_dir_and_explicit_tag(tmp_path):
    groups = [make_params(STAGE12_GROUPS[1], seed=1)]
    d, want = write_stage12(tmp_path, 2, groups, tag="step_a", latest=False)
    assert_same_state(z2f.get_fp32_state_dict_from_zero_checkpoint(d), want)  # the tag folder itself
    assert_same_state(z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="step_a"), want)


def test_load_state_dict_from_zero_checkpoint(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    params = OrderedDict((k, v.detach().clone() + 1) for k, v in model.named_parameters())
    write_stage12(tmp_path, 2, [params])
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    out = z2f.load_state_dict_from_zero_checkpoint(fresh, str(tmp_path))
    assert out is fresh
    for k, v in out.named_parameters():
        assert torch.equal(v.detach(), params[k])


# =============================================================================== writers, CLI, streaming


def _big_stage2(tmp_path, world=2):
    groups = [make_params([("w%d" % i, (40 + i, 9)) for i in range(6)], seed=40)]
    return write_stage12(tmp_path / "ckpt", world, groups, buffers=_buffers(), shared={"alias": "w3"},
                         frozen=OrderedDict(fz=torch.ones(4)), bf16=True, param_align=8)


@pytest.mark.parametrize("safe", [False, True])
def test_convert_sharded_and_unsharded(tmp_path, safe):
    _, want = _big_stage2(tmp_path)
    want = as_fp32(want)
    out = tmp_path / "one"
    files = z2f.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out), safe_serialization=safe)
    assert files == ["model.safetensors" if safe else "pytorch_model.bin"]
    got, idx = load_output(str(out), safe)
    assert idx is None
    assert_same_state(got, want, check_order=not safe)
    if not safe:
        assert got["alias"] is got["w3"]  # tied names load as one tensor, as torch.save writes them
    shard = tmp_path / "sharded"
    files = z2f.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(shard), max_shard_size="3KB",
                                                           safe_serialization=safe)
    got, idx = load_output(str(shard), safe)
    assert idx is not None and len(files) > 3
    assert sorted(idx["weight_map"]) == sorted(want)
    assert idx["weight_map"]["alias"] == idx["weight_map"]["w3"]
    unique_bytes = sum(v.numel() * 4 for k, v in want.items() if k != "alias" and v.is_floating_point()) + 3 * 8
    assert idx["metadata"]["total_size"] == unique_bytes
    assert_same_state(got, want, check_order=False)
    # Hugging Face's rule: in key order, a new shard when the next tensor would overflow; an
    # oversized tensor alone. Every shard except such singletons stays within the limit.
    for name in set(idx["weight_map"].values()):
        keys = [k for k, v in idx["weight_map"].items() if v == name and k != "alias"]
        size = sum(want[k].numel() * want[k].element_size() for k in keys)
        assert size <= 3000 or len(keys) == 1
    assert not [n for n in os.listdir(shard) if n.startswith(".")]  # no scratch left behind


def test_safetensors_with_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    _, want = _big_stage2(tmp_path)
    z2f.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "o"), max_shard_size="3KB",
                                                   safe_serialization=True)
    got = {}
    for f in glob.glob(str(tmp_path / "o" / "*.safetensors")):
        got.update(st.load_file(f))
    assert_same_state(got, as_fp32(want), check_order=False)


def test_streaming_one_parameter_alive_at_a_time(tmp_path, monkeypatch):
    _big_stage2(tmp_path)
    alive, peak = [], [0]
    real = z2f._LazyTensor.contiguous

    def tracking(self, dtype=None):
        t = real(self, dtype)
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(t))
        peak[0] = max(peak[0], len(alive))
        return t

    monkeypatch.setattr(z2f._LazyTensor, "contiguous", tracking)
    for safe in (False, True):
        peak[0] = 0
        alive.clear()
        z2f.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / f"o{safe}"),
                                                       safe_serialization=safe)
        assert peak[0] == 1, f"{peak[0]} materialized tensors alive at once (safe_serialization={safe})"


def test_inputs_are_memory_mapped(tmp_path, monkeypatch):
    _big_stage2(tmp_path)
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mmap"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(z2f.torch, "load", spy)
    z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), lazy_mode=True)
    assert calls and all(calls)


def test_parse_size():
    assert z2f._parse_size("5GB") == 5 * 10**9
    assert z2f._parse_size("1.5MB") == 1_500_000
    assert z2f._parse_size("2GiB") == 2 * 2**30
    assert z2f._parse_size(1234) == 1234 and z2f._parse_size("77") == 77
    with pytest.raises(ValueError, match="max_shard_size"):
        z2f._parse_size("5 parsecs")


def test_source_is_standalone():
    tree = ast.parse(open(SCRIPT).read())
    allowed = {"argparse", "bisect", "json", "math", "os", "pickle", "re", "struct", "sys", "warnings",
               "collections", "torch", "tqdm", "numpy", "io", "ctypes"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module or "").split(".")[0]]
        else:
            continue
        assert set(mods) <= allowed, mods


def _fixture_dirs():
    return [pytest.param(os.path.join(FIXTURES, f"stage{s}_{d}"), id=f"stage{s}_{d}") for s in (1, 2, 3)
            for d in ("fp32", "bf16")]


def _need_fixture(path):
    if not os.path.isfile(os.path.join(path, "consolidated_fp32.pt")):
        pytest.skip(f"fixture {os.path.basename(path)} not generated")


def test_cli_copied_into_checkpoint_runs_without_deepspeed(tmp_path):
    """As the engine does: the script copied next to the tag folders, run with plain python."""
    candidates = [p.values[0] for p in _fixture_dirs() if os.path.isfile(os.path.join(p.values[0], "consolidated_fp32.pt"))]
    if candidates:
        ckpt = tmp_path / "ckpt"
        shutil.copytree(candidates[0], ckpt)
        want = as_fp32(torch.load(str(ckpt / "consolidated_fp32.pt"), weights_only=True))
    else:
        groups = [make_params(STAGE12_GROUPS[0], seed=2)]
        _, want = write_stage12(tmp_path / "ckpt", 2, groups, buffers=_buffers())
        want = as_fp32(want)
        ckpt = tmp_path / "ckpt"
    script = ckpt / "zero_to_fp32.py"
    shutil.copy(SCRIPT, script)
    code = ("import runpy, sys; sys.argv = sys.argv[1:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "bad = [m for m in sys.modules if m == 'deepspeed' or m.startswith('deepspeed.')]\n"
            "assert not bad, bad\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(script), ".", "out", "--max_shard_size", "2KB"],
                          cwd=str(ckpt), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got, idx = load_output(str(ckpt / "out"))
    assert idx is not None
    assert_same_state(got, want, check_order=False)


# =============================================================================== (a) DeepSpeed fixtures


@pytest.mark.parametrize("fixture", _fixture_dirs())
def test_deepspeed_fixture_matches_deepspeed_consolidation(fixture, tmp_path):
    _need_fixture(fixture)
    want = torch.load(os.path.join(fixture, "consolidated_fp32.pt"), weights_only=True)
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(fixture)
    assert_same_state(got, want)
    lazy = z2f.get_fp32_state_dict_from_zero_checkpoint(fixture, lazy_mode=True)
    assert_same_state({k: v.contiguous() for k, v in lazy.items()}, want)
    # the command line: one file, then tiny shards with an index
    assert z2f.main([fixture, str(tmp_path / "bin")]) == 0
    got, idx = load_output(str(tmp_path / "bin"))
    assert idx is None
    assert_same_state(got, as_fp32(want))
    assert z2f.main([fixture, str(tmp_path / "shards"), "--max_shard_size", "1KB"]) == 0
    got, idx = load_output(str(tmp_path / "shards"))
    assert idx is not None and sorted(idx["weight_map"]) == sorted(want)
    assert_same_state(got, as_fp32(want), check_order=False)
    assert z2f.main([fixture, str(tmp_path / "st"), "--safe_serialization", "--max_shard_size", "1KB"]) == 0
    got, idx = load_output(str(tmp_path / "st"), safe=True)
    assert_same_state(got, as_fp32(want), check_order=False)


@pytest.mark.parametrize("fixture", _fixture_dirs())
def test_deepspeed_fixture_safetensors_library(fixture, tmp_path):
    _need_fixture(fixture)
    st = pytest.importorskip("safetensors.torch")
    want = as_fp32(torch.load(os.path.join(fixture, "consolidated_fp32.pt"), weights_only=True))
    z2f.convert_zero_checkpoint_to_fp32_state_dict(fixture, str(tmp_path), safe_serialization=True)
    assert_same_state(st.load_file(str(tmp_path / "model.safetensors")), want, check_order=False)


def test_deepspeed_fixture_master_weights(tmp_path):
    """Independent of DeepSpeed's script: trainable params equal the engine's fp32 masters."""
    found = False
    for p in _fixture_dirs():
        path = p.values[0]
        master = os.path.join(path, "master_fp32_step3.pt")
        if not (os.path.isfile(master) and os.path.isfile(os.path.join(path, "latest"))):
            continue
        found = True
        got = z2f.get_fp32_state_dict_from_zero_checkpoint(path)
        for k, v in torch.load(master, weights_only=True).items():
            if k in got and got[k].dtype == torch.float32 and k != "frozen":
                assert torch.equal(got[k], v), (path, k)
    if not found:
        pytest.skip("no fixtures generated")


# =============================================================================== (c) errors


def test_error_missing_latest(tmp_path):
    write_stage12(tmp_path, 1, [make_params(STAGE12_GROUPS[1])], tag="global_step5", latest=False)
    with pytest.raises(ValueError, match=r"Unable to find 'latest'.*global_step5"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="nope")
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "missing"))


def test_error_missing_rank_file(tmp_path):
    d, _ = write_stage12(tmp_path, 4, [make_params(STAGE12_GROUPS[0])], bf16=True)
    os.remove(os.path.join(d, "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(z2f.ZeroCheckpointError,
                       match=r"Expected 4 .*found 3.*bf16_zero_pp_rank_2_mp_rank_00_optim_states\.pt"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_error_all_rank_files_missing(tmp_path):
    d, _ = write_stage12(tmp_path, 2, [make_params(STAGE12_GROUPS[0])])
    for f in glob.glob(os.path.join(d, "*_optim_states.pt")):
        os.remove(f)
    with pytest.raises(z2f.ZeroCheckpointError, match=r"saved by a ZeRO optimizer.*expected 2 .*found 0"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_error_extra_rank_file(tmp_path):
    d, _ = write_stage12(tmp_path, 2, [make_params(STAGE12_GROUPS[0])])
    shutil.copy(os.path.join(d, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                os.path.join(d, "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(z2f.ZeroCheckpointError, match=r"Expected 2 .*unexpected.*zero_pp_rank_2"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_error_truncated_file(tmp_path, victim, keep):
    d, _ = write_stage12(tmp_path, 2, [make_params(STAGE12_GROUPS[0])])
    path = os.path.join(d, victim)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    with pytest.raises(z2f.ZeroCheckpointError, match=victim.replace(".", r"\.") + r".*(truncated|empty)"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_error_stage0(tmp_path):
    d = os.path.join(tmp_path, "global_step1")
    os.makedirs(d)
    torch.save({"module": {"w": torch.ones(2)}, "buffer_names": [], "param_shapes": None},
               os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(tmp_path, "latest"), "w") as f:
        f.write("global_step1")
    with pytest.raises(z2f.ZeroCheckpointError, match=r"stage-0.*mp_rank_00_model_states\.pt.*already holds the full"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert z2f.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert not os.path.exists(tmp_path / "out")


def test_error_stage0_bf16_optimizer(tmp_path):
    # stage 0 with bf16: DeepSpeed's BF16_Optimizer writes bf16_zero_* files without 'zero_stage'
    d, _ = write_stage12(tmp_path, 2, [make_params(STAGE12_GROUPS[0])], bf16=True)
    for f in glob.glob(os.path.join(d, "bf16_zero_pp_rank_*")):
        sd = torch.load(f, weights_only=False)
        del sd["optimizer_state_dict"]["zero_stage"]
        torch.save(sd, f)
    with pytest.raises(z2f.ZeroCheckpointError, match=r"stage-0.*mp_rank_00_model_states\.pt.*already holds the full"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_error_stage0_deepspeed_fixture(dtype):
    path = os.path.join(FIXTURES, f"stage0_{dtype}")
    if not os.path.isfile(os.path.join(path, "latest")):
        pytest.skip("fixture not generated")
    with pytest.raises(z2f.ZeroCheckpointError, match="already holds the full weights"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(path)


def test_error_layout_mismatch(tmp_path):
    d, _ = write_stage12(tmp_path, 2, [make_params(STAGE12_GROUPS[0])])
    path = os.path.join(d, "mp_rank_00_model_states.pt")
    sd = torch.load(path, weights_only=False)
    sd["param_shapes"][0]["head.bias"] = torch.Size([50])  # more elements than the ranks saved
    torch.save(sd, path)
    with pytest.raises(z2f.ZeroCheckpointError, match="head.bias"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_error_cli_reports_message(tmp_path, capsys):
    assert z2f.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "Unable to find 'latest'" in capsys.readouterr().err


AUTOEP_ZERO3 = os.path.join(ROOT, "tests", "fixtures", "ds_0_19_8_autoep_zero3")


def test_deepspeed_autoep_zero3_checkpoint():
    """DeepSpeed 0.19.8's AutoEP ZeRO-3 checkpoint (experts partitioned inside its ZeRO-3 files, which its own
    zero_to_fp32 refuses): every parameter whole, experts [num_experts, ...], equal to DeepSpeed's own
    safe_get_full_fp32_param (expert rows gathered over the EP ranks) bit for bit."""
    expected = torch.load(os.path.join(AUTOEP_ZERO3, "expected.pt"), weights_only=False)["whole"]
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(os.path.join(AUTOEP_ZERO3, "ckpt"), tag="t")
    assert sorted(got) == sorted(expected)
    assert got["model.layers.0.mlp.experts.w1"].shape == (4, 8, 16)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_autoep_zero3_missing_rank_is_named(tmp_path):
    """An expert's pieces missing (one rank's partition lost) fail by name, not with a short tensor."""
    tag = tmp_path / "t"
    shutil.copytree(os.path.join(AUTOEP_ZERO3, "ckpt", "t"), tag)
    path = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    for entry in states["ds_autoep_layers"]:
        entry["global_expert_start"] = 0   # rank 1 now claims rank 0's experts: experts 2-3 have no pieces
    torch.save(states, path)
    with pytest.raises(z2f.ZeroCheckpointError, match="experts.w1.*elements .* saved twice"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
