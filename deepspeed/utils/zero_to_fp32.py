#!/usr/bin/env python
"""Consolidate a ZeRO (stage 1, 2 or 3) checkpoint into one full-precision (fp32) state dict.

This file is standalone on purpose: it imports only ``torch`` and the standard library (``tqdm``
and ``numpy`` are used when installed), never ``deepspeed``. The engine copies it into every
checkpoint directory as ``zero_to_fp32.py`` so the weights can be recovered later with plain
python, e.g.::

    python zero_to_fp32.py . output_dir/                       # -> output_dir/pytorch_model.bin
    python zero_to_fp32.py . output_dir/ --safe_serialization  # -> output_dir/model.safetensors
    python zero_to_fp32.py . output_dir/ --max_shard_size 2GB  # shards + *.index.json when needed

What it reads (the DeepSpeed 0.19.8 on-disk layout, one directory per tag, e.g. ``global_step3/``):

* ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per data-parallel rank ``r``.
  ``["optimizer_state_dict"]`` holds ``zero_stage``, ``partition_count`` and the rank's slice of
  the fp32 master weights: ``single_partition_of_fp32_groups`` (stages 1/2, one flat tensor per
  parameter group) or ``fp32_flat_groups`` (stage 3, one flat tensor per sub-group).
* ``mp_rank_00_model_states.pt`` (stages 1/2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3, one per rank): ``param_shapes`` (list per group of ordered ``{name: shape}``, the
  order in which the flat groups were built), ``buffer_names`` + ``module`` (buffers are taken
  from there), ``frozen_param_shapes`` / ``frozen_param_fragments`` (parameters the optimizer
  does not own; whole tensors at stage 2, per-rank partitions at stage 3) and ``shared_params``
  (``{alias: name}`` for tied parameters, which are stored once).

How the flat groups are laid out:

* Stages 1/2: a group is the concatenation of its parameters in ``param_shapes`` order, each
  followed by ``param_alignment_paddings[group][i]`` filler elements, then padded at the end to
  a multiple of the alignment; the padded group is cut into ``world_size`` equal partitions and
  each rank saves its partition with the end padding that fell into it removed. Concatenating
  the saved partitions of all ranks therefore gives the group back without its end padding.
* Stage 3: every parameter is padded to a multiple of ``world_size`` and cut into equal
  partitions of ``ceil(numel / world_size)``; rank ``r`` saves partition ``r`` of every
  parameter, one after another, across its sub-groups.

Streaming: every rank file is opened with ``torch.load(..., mmap=True)``, so nothing is read
until used (the Adam moments are never touched). A parameter is rebuilt by copying its slices out
of the mapped partitions into one fresh tensor, written to the current output shard and freed
before the next one is built; ``.bin`` shards are written record by record with torch's own
zip writer and ``.safetensors`` shards tensor by tensor, so the extra memory is about the largest
parameter, whatever the size of the model or of a shard. Pages of the mapped input files that
were read count in the process' RSS as clean, file-backed memory that the kernel can drop at
any time.

Loading safely: DeepSpeed pickles a few of its own objects next to the tensors (loss scaler,
``ZeroStageEnum``, ``fragment_address``...). Files are loaded with ``weights_only=True``; when
that refuses a file because of such classes, the classes are replaced by inert stand-ins (they
store their arguments, run no code) registered with ``torch.serialization.safe_globals`` and
the file is loaded again with ``weights_only=True``. Only on torch < 2.5, which cannot do that,
does it fall back to a full ``weights_only=False`` unpickling (what DeepSpeed's own script always
does); a warning says so.
"""

import argparse
import bisect
import json
import math
import os
import pickle
import re
import struct
import sys
import warnings
from collections import OrderedDict

if __name__ == "__main__" and sys.path:
    # Run in place as deepspeed/utils/zero_to_fp32.py, the script's folder comes first on sys.path
    # and its logging.py would shadow the standard library's for torch: drop it.
    _here = os.path.dirname(os.path.abspath(__file__))
    if os.path.abspath(sys.path[0] or os.curdir) == _here and os.path.isfile(os.path.join(_here, "logging.py")):
        del sys.path[0]

import torch  # noqa: E402

try:  # optional: progress bars
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - depends on the environment
    _tqdm = None

try:  # optional: zero-copy writes of tensor bytes
    import numpy as _np  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    _np = None

__all__ = [
    "ZeroCheckpointError",
    "get_fp32_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "load_state_dict_from_zero_checkpoint",
]

# Set by ``-d/--debug`` on the command line (module global, as in DeepSpeed's script).
debug = False

# --- on-disk names ------------------------------------------------------------------------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
DS_VERSION = "ds_version"
AUTOEP_LAYERS = "ds_autoep_layers"
ZERO_PARTITION_GROUPS = "ds_zero_partition_groups"

_OPTIM_FILE_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_FILE_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")

OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Hugging Face size units (decimal, as huggingface_hub.parse_size_to_int) plus binary ones.
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1}


class ZeroCheckpointError(ValueError):
    """The checkpoint is incomplete, corrupt, or not one this script can consolidate."""


def _info(msg):
    print(msg, flush=True)


def _dbg(msg):
    if debug:
        print(f"[zero_to_fp32] {msg}", flush=True)


def _progress(iterable=None, total=None, desc=None, unit="it", unit_scale=False):
    """A tqdm bar when tqdm is installed (hidden when stderr is not a terminal), else nothing."""
    if _tqdm is None:
        return _NoBar(iterable)
    return _tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=None, leave=False)


class _NoBar:

    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def update(self, n=1):
        pass

    def close(self):
        pass


# =============================================================================== loading


class _Opaque:
    """Inert stand-in for a non-tensor class pickled in a checkpoint (loss scaler, enum, ...).

    It keeps the constructor arguments (``_args``) and the pickled state (``_state``) as plain
    data and runs no code of the original class.
    """

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj._args = args
        obj._state = None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self._state = state

    def __repr__(self):
        cls = type(self)
        return f"<stand-in for {cls.__module__}.{cls.__qualname__} args={self._args!r} state={self._state!r}>"


_STUBS = {}


def _stub_class(full_name):
    cls = _STUBS.get(full_name)
    if cls is None:
        module, _, name = full_name.rpartition(".")
        cls = type(name, (_Opaque, ), {"__module__": module, "__qualname__": name})
        _STUBS[full_name] = cls
    return cls


def _as_int(value, what, path):
    """An int from a plain int or from a stand-in for an IntEnum member such as ZeroStageEnum(2)."""
    if isinstance(value, bool):
        raise ZeroCheckpointError(f"{path}: {what} is {value!r}, expected an integer")
    if isinstance(value, int):
        return int(value)
    if isinstance(value, _Opaque) and len(value._args) == 1 and isinstance(value._args[0], int):
        return int(value._args[0])
    raise ZeroCheckpointError(f"{path}: {what} is {value!r}, expected an integer")


def _describe_load_error(path, exc):
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ZeroCheckpointError(f"'{path}' cannot be read as a torch checkpoint; the file is probably truncated "
                               f"or corrupt (an interrupted save or copy?). Error: {first}")


def _load_weights_only(path, mmap):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first_error = exc
    # DeepSpeed's own classes refused: replace them by inert stand-ins and try again.
    get_unsafe = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if get_unsafe is None or safe_globals is None:
        warnings.warn(f"torch {torch.__version__} cannot allowlist the non-tensor classes pickled in '{path}' "
                      "(needs torch >= 2.5); falling back to torch.load(weights_only=False). Only do this with "
                      "checkpoints you trust.")
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    names = get_unsafe(path)
    blocked = [n for n in names if n.split(".")[0] in ("os", "sys", "posix", "nt", "subprocess", "builtins")]
    if blocked:
        raise ZeroCheckpointError(f"'{path}' references {blocked} in its pickle; refusing to load it "
                                  f"(a DeepSpeed checkpoint never does). Original error: {first_error}")
    _dbg(f"{os.path.basename(path)}: inert stand-ins for {names}")
    with safe_globals([(_stub_class(n), n) for n in names]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise ZeroCheckpointError(f"'{path}' cannot be unpickled safely: {exc}") from exc


def _load_file(path):
    """torch.load a checkpoint file, memory-mapped, without executing pickled code."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file '{path}' doesn't exist")
    if os.path.getsize(path) == 0:
        raise ZeroCheckpointError(f"'{path}' is empty (0 bytes); the save was interrupted or the copy is incomplete")
    try:
        return _load_weights_only(path, mmap=True)
    except ZeroCheckpointError:
        raise
    except RuntimeError as exc:
        if "mmap can only be used with files saved with" in str(exc):  # legacy (non-zip) torch.save format
            try:
                return _load_weights_only(path, mmap=False)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as exc2:
                raise _describe_load_error(path, exc2) from exc2
        raise _describe_load_error(path, exc) from exc
    except (EOFError, pickle.UnpicklingError, OSError, ValueError) as exc:
        raise _describe_load_error(path, exc) from exc


# =============================================================================== lazy tensors


def _numel(shape):
    return int(math.prod(int(s) for s in shape))


class _Flat:
    """A virtual 1-D concatenation of several 1-D tensors (the partitions of a flat group)."""

    def __init__(self, tensors, what):
        self.tensors = [t.detach().reshape(-1) for t in tensors]
        self.what = what
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())
        self.numel = self.starts[-1]
        dtypes = {t.dtype for t in self.tensors if t.numel()}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else (self.tensors[0].dtype if self.tensors else torch.float32)
        if dtypes:
            raise ZeroCheckpointError(f"{what}: partitions have different dtypes {sorted(map(str, dtypes))}")

    def pieces(self, start, length, dst, name):
        """[(tensor, tensor_start, n, dst_start)] covering elements [start, start + length)."""
        if start < 0 or start + length > self.numel:
            raise ZeroCheckpointError(f"{self.what}: parameter '{name}' needs elements [{start}, {start + length}) "
                                      f"but only {self.numel} were saved; the checkpoint does not match its "
                                      f"param_shapes (incomplete or from another model)")
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        pos = start
        end = start + length
        while pos < end:
            t_start, t_end = self.starts[i], self.starts[i + 1]
            n = min(end, t_end) - pos
            if n > 0:
                out.append((self.tensors[i], pos - t_start, n, dst + (pos - start)))
                pos += n
            i += 1
        return out


class _LazyTensor:
    """A parameter not built yet: ``.contiguous()`` copies its slices out of the mapped files.

    Stands in for a tensor in ``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)``;
    has ``shape``, ``dtype``, ``numel()``, ``size()``, ``nbytes`` and ``element_size()``.
    Entries that are the same object are tied parameters.
    """

    def __init__(self, name, shape, dtype, pieces):
        self.name = name
        self.shape = torch.Size([int(s) for s in shape])
        self.dtype = dtype
        self._pieces = pieces

    def numel(self):
        return _numel(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return len(self.shape)

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()  # host: a size

    @property
    def nbytes(self):
        return self.numel() * self.element_size()

    def contiguous(self, dtype=None):
        """Materialize as a fresh CPU tensor (of ``dtype`` when given, else of ``self.dtype``)."""
        out = torch.empty(self.numel(), dtype=dtype or self.dtype)  # host: offline tool
        with torch.no_grad():
            for src, src_start, n, dst_start in self._pieces:
                out.narrow(0, dst_start, n).copy_(src.narrow(0, src_start, n))
        return out.view(self.shape)

    materialize = contiguous

    def flat_slice(self, start, numel, dtype=None):
        """Elements [start, start + numel) of the flattened tensor as a fresh CPU tensor: only those are copied
        (read) out of the mapped partitions."""
        out = torch.empty(numel, dtype=dtype or self.dtype)  # host: offline tool
        with torch.no_grad():
            for src, src_start, n, dst_start in self._pieces:
                lo, hi = max(start, dst_start), min(start + numel, dst_start + n)
                if lo < hi:
                    out.narrow(0, lo - start, hi - lo).copy_(src.narrow(0, src_start + lo - dst_start, hi - lo))
        return out

    def to(self, dtype=None):
        return self.contiguous(dtype)

    def __repr__(self):
        return f"_LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _whole(name, tensor, dtype=None):
    t = tensor.detach()
    return _LazyTensor(name, t.shape, dtype or t.dtype, [(t.reshape(-1), 0, t.numel(), 0)] if t.numel() else [])


# =============================================================================== checkpoint layout


def _is_tag_dir(path):
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith("_optim_states.pt") or n.endswith("_model_states.pt") for n in names)


def _wait_for_background_saves():
    """In a process that trained with this package, its background checkpoint saves finish before
    a checkpoint is read (standalone, without deepspeed imported, there is nothing to wait for)."""
    save_job = sys.modules.get("deepspeed.runtime.checkpoint.save_job")
    if save_job is not None and hasattr(save_job, "wait_all_local"):
        save_job.wait_all_local()


def _resolve_tag_dir(checkpoint_dir, tag):
    _wait_for_background_saves()
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Checkpoint directory '{checkpoint_dir}' doesn't exist")
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if os.path.isfile(latest):
            with open(latest, "r") as fd:
                tag = fd.read().strip()
            if not tag:
                raise ValueError(f"'{latest}' is empty; pass the tag explicitly (tag=... or --tag)")
        elif _is_tag_dir(checkpoint_dir):
            return checkpoint_dir  # the user pointed at the tag directory itself
        else:
            tags = sorted(d for d in os.listdir(checkpoint_dir) if _is_tag_dir(os.path.join(checkpoint_dir, d)))
            hint = f"; tag directories found there: {tags}" if tags else ""
            raise ValueError(f"Unable to find 'latest' file at {latest} and no tag was given (tag=... or "
                             f"--tag){hint}")
    ds_dir = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(ds_dir):
        raise FileNotFoundError(f"Directory '{ds_dir}' doesn't exist (tag '{tag}')")
    return ds_dir


def _natural_key(name):
    """Sort key that orders embedded numbers by value (rank 10 after rank 9)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def get_checkpoint_files(checkpoint_dir, glob_pattern):
    """Files of a tag directory matching `glob_pattern`, in natural order; FileNotFoundError if none."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    pattern = re.compile(re.escape(glob_pattern).replace(r"\*", ".*").replace(r"\?", ".") + r"\Z")
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    found = [os.path.join(checkpoint_dir, n) for n in sorted(names, key=_natural_key) if pattern.match(n)]
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def _files(checkpoint_dir, glob_pattern):
    """get_checkpoint_files, empty when none match."""
    try:
        return get_checkpoint_files(checkpoint_dir, glob_pattern)
    except FileNotFoundError:
        return []


def get_optim_files(checkpoint_dir):
    """The `*_optim_states.pt` files of a tag directory, rank order (DeepSpeed's helper, used by Lightning)."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir):
    """The `*_model_states.pt` files of a tag directory, rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir, zero_stage):
    """The model-states file holding the client state: `mp_rank_00_model_states.pt` at stages 0-2,
    rank 0's `zero_pp_rank_0_mp_rank_00_model_states.pt` at stage 3 (DeepSpeed's helper)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    stage = _as_int(zero_stage, ZERO_STAGE, checkpoint_dir)
    name = "mp_rank_00_model_states.pt" if stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _optim_file_name(prefix, rank, mp):
    return f"{prefix + '_' if prefix else ''}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


class _Checkpoint:
    """The parsed metadata of one tag directory; tensors stay memory-mapped."""

    def __init__(self, ds_dir, mp_rank=0):
        self.ds_dir = ds_dir
        self.mp_rank = mp_rank   # a pipeline checkpoint has one set of files per stage
        names = sorted(os.listdir(ds_dir))
        optim = {}
        prefixes, mps = set(), set()
        for n in names:
            m = _OPTIM_FILE_RE.match(n)
            if m:
                prefix, rank, mp = m.group(1) or "", int(m.group(2)), int(m.group(3))
                mps.add(mp)
                if mp != mp_rank:
                    continue
                prefixes.add(prefix)
                optim[rank] = os.path.join(ds_dir, n)
        if not optim:
            model_files = [n for n in names if _MODEL_FILE_RE.match(n) or _ZERO3_MODEL_FILE_RE.match(n)]
            if model_files:
                model_path = os.path.join(ds_dir, model_files[0])
                model = _load_file(model_path)
                if isinstance(model, dict) and model.get(PARAM_SHAPES) is not None:
                    raise ZeroCheckpointError(
                        f"'{ds_dir}' has no '*_optim_states.pt' files, but '{model_path}' was saved by a ZeRO "
                        f"optimizer (it has param_shapes): expected {model.get('dp_world_size', '?')} optimizer "
                        "state files (one per data-parallel rank), found 0; they hold the fp32 weights")
                raise ZeroCheckpointError(
                    f"'{ds_dir}' is a stage-0 (non-ZeRO) checkpoint: it has no '*_optim_states.pt' files, so there "
                    f"is nothing to consolidate. '{os.path.join(ds_dir, model_files[0])}' already holds the full "
                    f"weights: torch.load(that_file)['module'] is the model's state dict.")
            raise FileNotFoundError(f"can't find '*_optim_states.pt' files in directory '{ds_dir}'")
        if len(prefixes) > 1:
            raise ZeroCheckpointError(f"'{ds_dir}' mixes optimizer files with different prefixes "
                                      f"{sorted(p or '(none)' for p in prefixes)}; remove the stale ones")
        if mps != set(range(len(mps))):
            raise ZeroCheckpointError(f"'{ds_dir}' has optimizer files of model-parallel ranks {sorted(mps)}; "
                                      f"expected ranks 0-{len(mps) - 1}")
        self.mp_world_size = len(mps)
        self.prefix = prefixes.pop()
        first_rank = min(optim)
        first = _load_file(optim[first_rank])
        osd = first.get(OPTIMIZER_STATE_DICT) if isinstance(first, dict) else None
        if not isinstance(osd, dict):
            raise ZeroCheckpointError(f"'{optim[first_rank]}' has no '{OPTIMIZER_STATE_DICT}' dict; it is not a "
                                      "DeepSpeed ZeRO optimizer checkpoint")
        if ZERO_STAGE not in osd:
            raise ZeroCheckpointError(
                f"'{optim[first_rank]}' has no '{ZERO_STAGE}': it was written by the stage-0 bf16 optimizer, so this "
                f"is a stage-0 (non-ZeRO) checkpoint and there is nothing to consolidate: "
                f"'{os.path.join(ds_dir, 'mp_rank_00_model_states.pt')}' already holds the full weights (in the "
                f"training dtype) under its 'module' key")
        self.stage = _as_int(osd[ZERO_STAGE], ZERO_STAGE, optim[first_rank])
        if self.stage not in (1, 2, 3):
            raise ZeroCheckpointError(f"'{optim[first_rank]}': unknown zero stage {self.stage}")
        pc = osd.get(PARTITION_COUNT)
        if pc is None:
            raise ZeroCheckpointError(f"'{optim[first_rank]}' has no '{PARTITION_COUNT}'")
        counts = [_as_int(c, PARTITION_COUNT, optim[first_rank]) for c in (pc if isinstance(pc, (list, tuple)) else [pc])]
        # Expert groups may be partitioned over fewer ranks; the files are one per rank of the largest.
        self.world_size = max(counts)
        expected = set(range(self.world_size))
        if set(optim) != expected:
            missing = [_optim_file_name(self.prefix, r, mp_rank) for r in sorted(expected - set(optim))]
            extra = [os.path.basename(optim[r]) for r in sorted(set(optim) - expected)]
            what = []
            if missing:
                what.append(f"missing {missing}")
            if extra:
                what.append(f"unexpected {extra}")
            raise ZeroCheckpointError(
                f"Expected {self.world_size} '*_optim_states.pt' files under '{ds_dir}' (partition_count="
                f"{pc} in '{os.path.basename(optim[first_rank])}') but found {len(optim)}: {'; '.join(what)}. "
                "Possibly an overwrite of an older checkpoint, or one or more ranks did not finish saving.")
        self.optim_files = [optim[r] for r in range(self.world_size)]
        self.optim_states = [None] * self.world_size
        self.optim_states[first_rank] = osd
        self._first = first
        self.ds_version = first.get(DS_VERSION) if isinstance(first, dict) else None

        if self.stage <= 2:
            self.model_files = [os.path.join(ds_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")]
        else:
            self.model_files = [os.path.join(ds_dir, f"zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_model_states.pt")
                                for r in range(self.world_size)]
        self.model_states = [None] * len(self.model_files)
        self.model0 = self.model_state(0)
        if not isinstance(self.model0, dict) or BUFFER_NAMES not in self.model0 or PARAM_SHAPES not in self.model0:
            raise ZeroCheckpointError(f"'{self.model_files[0]}' is not a model states checkpoint (no "
                                      f"'{BUFFER_NAMES}'/'{PARAM_SHAPES}')")
        if self.model0[PARAM_SHAPES] is None:
            raise ZeroCheckpointError(f"'{self.model_files[0]}' has param_shapes=None: it was not saved by a ZeRO "
                                      "optimizer")

    def optim_state(self, rank):
        if self.optim_states[rank] is None:
            path = self.optim_files[rank]
            sd = _load_file(path)
            osd = sd.get(OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
            if not isinstance(osd, dict):
                raise ZeroCheckpointError(f"'{path}' has no '{OPTIMIZER_STATE_DICT}' dict")
            stage = _as_int(osd.get(ZERO_STAGE), ZERO_STAGE, path)
            if stage != self.stage:
                raise ZeroCheckpointError(f"'{path}' says zero stage {stage} but '{self.optim_files[0]}' says "
                                          f"{self.stage}; the directory mixes checkpoints")
            self.optim_states[rank] = osd
        return self.optim_states[rank]

    def model_state(self, index):
        if self.model_states[index] is None:
            path = self.model_files[index]
            if not os.path.isfile(path):
                raise FileNotFoundError(f"can't find model states file at '{path}'")
            self.model_states[index] = _load_file(path)
        return self.model_states[index]

    def groups(self, rank):
        key = SINGLE_PARTITION_OF_FP32_GROUPS if self.stage <= 2 else FP32_FLAT_GROUPS
        osd = self.optim_state(rank)
        groups = osd.get(key)
        if groups is None:
            raise ZeroCheckpointError(f"'{self.optim_files[rank]}' has no '{key}' (the fp32 master weights)")
        if torch.is_tensor(groups):
            groups = [groups]
        groups = list(groups)
        bad = [type(g).__name__ for g in groups if not torch.is_tensor(g)]
        if bad:
            raise ZeroCheckpointError(f"'{self.optim_files[rank]}': '{key}' holds {bad} where tensors were expected")
        return groups


def _buffers(ckpt):
    """Persistent buffers from the module state dict, floats upcast to fp32 (as DeepSpeed does)."""
    out = OrderedDict()
    sd = ckpt.model0.get("module") or {}
    names = set(ckpt.model0.get(BUFFER_NAMES) or [])
    for k, v in sd.items():
        if k in names and torch.is_tensor(v):
            out[k] = _whole(k, v, torch.float32 if v.is_floating_point() else v.dtype)
    return out


def _layer_buffers(ckpt):
    """A pipeline stage's persistent buffers, from its `layer_XX-*model_states.pt` files (the
    model-states file holds no module); names are `<layer index>.<name>`."""
    out = OrderedDict()
    wanted = set(ckpt.model0.get(BUFFER_NAMES) or [])
    if not wanted:
        return out
    for name in sorted(os.listdir(ckpt.ds_dir)):
        m = re.match(r"^layer_(\d+)-.*model_states\.pt$", name)
        if not m:
            continue
        for k, v in _load_file(os.path.join(ckpt.ds_dir, name)).items():
            full = f"{int(m.group(1))}.{k}"
            if full in wanted and torch.is_tensor(v):
                out[full] = _whole(full, v, torch.float32 if v.is_floating_point() else v.dtype)
    return out


def _frozen(ckpt):
    shapes = ckpt.model0.get(FROZEN_PARAM_SHAPES)
    out = OrderedDict()
    if not shapes:
        return out
    ws = ckpt.world_size
    for name, shape in shapes.items():
        numel = _numel(shape)
        if ckpt.stage <= 2:
            frag = (ckpt.model0.get(FROZEN_PARAM_FRAGMENTS) or {}).get(name)
            if not torch.is_tensor(frag):
                raise ZeroCheckpointError(f"'{ckpt.model_files[0]}': frozen parameter '{name}' has a shape but no "
                                          f"entry in '{FROZEN_PARAM_FRAGMENTS}'")
            if frag.numel() != numel:
                raise ZeroCheckpointError(f"'{ckpt.model_files[0]}': frozen parameter '{name}' has {frag.numel()} "
                                          f"elements, its shape {tuple(shape)} needs {numel}")
            out[name] = _LazyTensor(name, shape, frag.dtype, [(frag.detach().reshape(-1), 0, numel, 0)] if numel else [])
        else:
            part = math.ceil(numel / ws)
            pieces, dtype = [], None
            for r in range(ws):
                frag = (ckpt.model_state(r).get(FROZEN_PARAM_FRAGMENTS) or {}).get(name)
                if not torch.is_tensor(frag):
                    raise ZeroCheckpointError(f"'{ckpt.model_files[r]}' has no fragment of frozen parameter '{name}'")
                dtype = dtype or frag.dtype
                take = min(part, numel - r * part)
                if take <= 0:
                    continue
                if frag.numel() < take:
                    raise ZeroCheckpointError(f"'{ckpt.model_files[r]}': fragment of frozen parameter '{name}' has "
                                              f"{frag.numel()} elements, expected {part}")
                pieces.append((frag.detach().reshape(-1), 0, take, r * part))
            out[name] = _LazyTensor(name, shape, dtype, pieces)
        _dbg(f"frozen {name} shape {tuple(shape)}")
    return out


def _trainable_stage12(ckpt):
    ws = ckpt.world_size
    param_shapes = ckpt.model0[PARAM_SHAPES]
    per_rank = [ckpt.groups(r) for r in range(ws)]
    for r, groups in enumerate(per_rank):
        if len(groups) != len(param_shapes):
            raise ZeroCheckpointError(f"'{ckpt.optim_files[r]}' has {len(groups)} parameter groups but "
                                      f"'{ckpt.model_files[0]}' describes {len(param_shapes)}")
    paddings = ckpt.optim_state(0).get(PARAM_ALIGNMENT_PADDINGS)
    out = OrderedDict()
    for g, shapes in enumerate(param_shapes):
        flat = _Flat([per_rank[r][g] for r in range(ws)], f"'{ckpt.ds_dir}' group {g}")
        pads = None
        if paddings is not None:
            pads = list(paddings[g])
            if len(pads) != len(shapes):
                raise ZeroCheckpointError(f"'{ckpt.optim_files[0]}': group {g} has {len(pads)} parameter alignment "
                                          f"paddings for {len(shapes)} parameters")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = _numel(shape)
            out[name] = _LazyTensor(name, shape, flat.dtype, flat.pieces(offset, numel, 0, name))
            _dbg(f"group {g} {name} shape {tuple(shape)} at {offset}")
            offset += numel + (int(pads[i]) if pads else 0)
        # Saved partitions hold the group without its end padding. Older versions padded to a
        # multiple of 2 * world_size less predictably, so compare both rounded up to that.
        align = 2 * ws
        if math.ceil(offset / align) != math.ceil(flat.numel / align):
            raise ZeroCheckpointError(f"'{ckpt.ds_dir}' group {g}: the parameters use {offset} elements but the "
                                      f"ranks saved {flat.numel}; the checkpoint does not match its param_shapes")
    return out


def _trainable_stage3(ckpt):
    ws = ckpt.world_size
    flats = [_Flat(ckpt.groups(r), f"'{ckpt.optim_files[r]}' {FP32_FLAT_GROUPS}") for r in range(ws)]
    sizes = {f.numel for f in flats}
    if len(sizes) != 1:
        raise ZeroCheckpointError(f"'{ckpt.ds_dir}': ranks saved different numbers of fp32 elements "
                                  f"{[f.numel for f in flats]}; expected equal partitions")
    shapes = OrderedDict()
    for group in ckpt.model0[PARAM_SHAPES]:
        shapes.update(group)
    out = OrderedDict()
    offset = 0
    for name, shape in shapes.items():
        numel = _numel(shape)
        part = math.ceil(numel / ws)
        pieces = []
        for r in range(ws):
            take = min(part, numel - r * part)
            if take <= 0:
                break
            pieces.extend(flats[r].pieces(offset, take, r * part, name))
        out[name] = _LazyTensor(name, shape, flats[0].dtype, pieces)
        _dbg(f"{name} shape {tuple(shape)} partition {part} at {offset}")
        offset += part
    if offset != flats[0].numel:
        raise ZeroCheckpointError(f"'{ckpt.ds_dir}': the parameters use {offset} elements per rank but each rank "
                                  f"saved {flats[0].numel}; the checkpoint does not match its param_shapes")
    return out


def is_autoep_zero3_partitioned(model_state):
    """DeepSpeed 0.19.8's marker of an AutoEP ZeRO-3 checkpoint: experts partitioned inside the ZeRO-3
    files (`ds_autoep_layers` entries with checkpoint_format "zero3_partitioned"), no expert files."""
    layers = model_state.get(AUTOEP_LAYERS) if isinstance(model_state, dict) else None
    return isinstance(layers, list) and any(isinstance(e, dict) and e.get("checkpoint_format") == "zero3_partitioned"
                                            for e in layers)


def join_autoep_zero3(model_states, optim_states, where):
    """Whole tensors of an AutoEP ZeRO-3 checkpoint, as ({field: {name: _LazyTensor}}, {name: whole shape}).

    Rank r's `param_shapes[g]` and flats (`fp32_flat_groups[g]`, each optimizer state of sub-group g) hold
    piece p of every parameter, elements [p*s, (p+1)*s) with s = ceil(numel/count), where
    `ds_zero_partition_groups[g]` gives count and p: dense sub-groups are cut over the data-parallel ranks,
    expert sub-groups (this EP rank's rows, [num_local_experts, ...]) over the expert's replica group. An
    expert's whole tensor [num_experts, ...] holds EP rank e's rows from its `global_expert_start`."""
    pieces, shapes, spans = {}, OrderedDict(), {}
    for r, (ms, osd) in enumerate(zip(model_states, optim_states)):
        layers = [(e["expert_key_prefix"] + ".", e) for e in ms.get(AUTOEP_LAYERS) or [] if isinstance(e, dict)]
        param_shapes, groups = ms.get(PARAM_SHAPES) or [], osd.get(ZERO_PARTITION_GROUPS)
        flats = {"fp32": [t.reshape(-1) for t in osd[FP32_FLAT_GROUPS]]}
        base = (osd.get(OPTIMIZER_STATE_DICT) or {}).get("state") or {}
        for g in range(len(param_shapes)):
            for field, value in (base.get(g) or {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flats.setdefault(field, [None] * len(param_shapes))[g] = value.reshape(-1)
        if len(flats["fp32"]) != len(param_shapes) or groups is None or len(groups) != len(param_shapes):
            raise ZeroCheckpointError(f"'{where}' rank {r}: {len(param_shapes)} param_shapes groups, "
                                      f"{len(flats['fp32'])} fp32 flat groups and "
                                      f"{'no' if groups is None else len(groups)} {ZERO_PARTITION_GROUPS} entries; an "
                                      "AutoEP ZeRO-3 checkpoint has one of each per sub-group")
        for g, group_shapes in enumerate(param_shapes):
            count, part = int(groups[g]["partition_count"]), int(groups[g]["partition_rank"])
            offset = 0
            for name, shape in group_shapes.items():
                numel = _numel(shape)
                size = -(-numel // count)
                entry = next((e for prefix, e in layers if name.startswith(prefix)), None)
                whole, dst = tuple(int(d) for d in shape), part * size
                if entry is not None:   # this EP rank's rows of the whole expert tensor
                    whole = (int(entry["num_experts"]),) + whole[1:]
                    dst += int(entry["global_expert_start"]) * (numel // int(entry["num_local_experts"]))
                if shapes.setdefault(name, whole) != whole:
                    raise ZeroCheckpointError(f"'{where}': '{name}' is {shapes[name]} on one rank, {whole} on rank {r}")
                take = max(0, min(size, numel - part * size))
                for field, flat in flats.items():
                    if take and flat[g] is not None:
                        pieces.setdefault(field, {}).setdefault(name, []).append((flat[g], offset, take, dst))
                spans.setdefault(name, []).append((dst, dst + take, r))
                offset += size
            if offset != flats["fp32"][g].numel():
                raise ZeroCheckpointError(f"'{where}' rank {r} sub-group {g}: the parameters use {offset} elements, "
                                          f"the rank saved {flats['fp32'][g].numel()}")
    for name, shape in shapes.items():   # every element exactly once
        end = 0
        for lo, hi, r in sorted(s for s in spans.get(name, []) if s[1] > s[0]) + [(_numel(shape), None, None)]:
            if lo != end:
                raise ZeroCheckpointError(f"'{where}': '{name}' {shape}: elements [{min(lo, end)}, {max(lo, end)}) "
                                          f"are {'missing from' if lo > end else 'saved twice in'} the optimizer "
                                          f"files{'' if r is None else f' (rank {r})'}")
            end = hi if hi is not None else end
    values = {field: {n: _LazyTensor(n, shapes[n], torch.float32, p) for n, p in by_name.items()}
              for field, by_name in pieces.items()}
    return values, shapes


def _autoep_zero3_state_dict(ckpt, exclude_frozen_parameters):
    """An AutoEP ZeRO-3 checkpoint (DeepSpeed 0.19.8's layout): buffers, frozen parameters, then every
    trained parameter whole, experts [num_experts, ...] (join_autoep_zero3)."""
    ranks = range(ckpt.world_size)
    values, shapes = join_autoep_zero3([ckpt.model_state(r) for r in ranks], [ckpt.optim_state(r) for r in ranks],
                                       ckpt.ds_dir)
    state = _buffers(ckpt)
    if not exclude_frozen_parameters:
        state.update(_frozen(ckpt))
    for name in shapes:
        state.setdefault(name, values["fp32"][name])
    for alias, target in (ckpt.model0.get(SHARED_PARAMS) or {}).items():
        if target in state:
            state[alias] = state[target]
    _info(f"AutoEP ZeRO-3 checkpoint: {len(shapes)} trained parameters from {ckpt.world_size} ranks")
    return state


def _lazy_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """{name: _LazyTensor} in DeepSpeed's order: buffers, frozen params, trainable params, aliases."""
    ds_dir = _resolve_tag_dir(checkpoint_dir, tag)
    _info(f"Processing zero checkpoint '{ds_dir}'")
    if _files(ds_dir, "layer_*_expert_*_model_states.pt"):
        return _moe_state_dict(ds_dir, exclude_frozen_parameters)
    ckpt = _Checkpoint(ds_dir)
    _info(f"Detected checkpoint of type zero stage {ckpt.stage}, world_size: {ckpt.world_size}"
          + (f" (written by deepspeed=={ckpt.ds_version})" if ckpt.ds_version else ""))
    if ckpt.stage == 3 and is_autoep_zero3_partitioned(ckpt.model0):
        return _autoep_zero3_state_dict(ckpt, exclude_frozen_parameters)
    parts = [ckpt]
    tp_dims = ckpt.model0.get("tp_partition_dims")
    pipeline = ckpt.model0.get("module") is None and bool(_files(ds_dir, "layer_*-model_states.pt"))
    if ckpt.mp_world_size > 1 and tp_dims and ckpt.stage in (1, 2, 3) and not pipeline:
        return _tp_state_dict(ckpt, tp_dims, exclude_frozen_parameters)
    if ckpt.mp_world_size > 1:
        if ckpt.model0.get("module") is not None or ckpt.stage > 2:
            raise ZeroCheckpointError(f"'{ds_dir}' has {ckpt.mp_world_size} model-parallel ranks: consolidating "
                                      "tensor-parallel checkpoints is not supported (pipeline stages at ZeRO 0-2 are)")
        # pipeline stages: parameter names carry the global layer index, so the stages' state
        # dicts are disjoint except for tied weights (equal on every stage that holds them)
        parts += [_Checkpoint(ds_dir, mp_rank=m) for m in range(1, ckpt.mp_world_size)]
        tp = _layer_tensor_ranks(ds_dir)
        if tp > 1:
            return _pipe_tp_state_dict(parts, tp, exclude_frozen_parameters)
        _info(f"Pipeline checkpoint: {ckpt.mp_world_size} stages")
    state = OrderedDict()
    for part in parts:
        state.update(_buffers(part) if part.model0.get("module") is not None else _layer_buffers(part))
        if not exclude_frozen_parameters:
            state.update(_frozen(part))
    for part in parts:
        for name, value in (_trainable_stage12(part) if part.stage <= 2 else _trainable_stage3(part)).items():
            state.setdefault(name, value)
    for part in parts:
        for alias, target in (part.model0.get(SHARED_PARAMS) or {}).items():
            if target in state:
                state[alias] = state[target]  # the same object: tied
    n_params = len({id(v) for v in state.values()})
    total = sum(v.numel() for v in {id(v): v for v in state.values()}.values())
    _info(f"Reconstructed state dict: {len(state)} entries ({n_params} distinct tensors), {total} elements")
    return state


def _without_router_aliases(module, layers):
    """`module` without the router aliases of whole-block AutoEP layers (DeepSpeed's AutoEPMoELayer registers its
    router also under the block's router name, `<block>.gate.gate.weight` beside `<block>.router.gate.weight`:
    one tensor; [Note: AutoEP router alias] in module_inject/auto_ep_alias.py): under a layer's block, an entry of
    another child equal to the router's entry of the same leaf name. DeepSpeed's consolidations walk each
    parameter once, so the alias is not in theirs either."""
    drop = set()
    for layer in layers or ():
        block = layer.get("module_path") if isinstance(layer, dict) else None
        if block is None:
            continue
        head = f"{block}." if block else ""
        for key, value in module.items():
            child, _, leaf = key[len(head):].partition(".")
            router = module.get(f"{head}router.{leaf}")
            if key.startswith(head) and child not in ("router", "experts") and torch.is_tensor(value) and \
                    torch.is_tensor(router) and value.shape == router.shape and torch.equal(value, router):
                drop.add(key)
    return OrderedDict((k, v) for k, v in module.items() if k not in drop) if drop else module


def _moe_state_dict(ds_dir, exclude_frozen_parameters):
    """An expert-parallel checkpoint (this package's MoE layout: `layer_<L>_expert_<E>_...` files hold
    each expert under its global name, the optimizer files `ds_moe_pieces`: named slices of the fp32
    masters): buffers and untrained tensors from the model files, every trained parameter joined
    from its slices, each expert once under its global name. With tensor parallelism (one
    `mp_rank_<t>` file set per tensor rank) a parameter sliced over the tensor ranks (`tp_partition_dims`,
    `tensor_model_parallel_dims`) is its slices joined in tensor-rank order; the others (replicated
    layers, whole experts) are equal wherever they appear, tensor rank 0's taken first."""
    tps = sorted(int(m.group(1)) for m in map(_MODEL_FILE_RE.match, os.listdir(ds_dir)) if m)
    if not tps or tps != list(range(len(tps))):
        raise ZeroCheckpointError(f"'{ds_dir}': the MoE checkpoint's mp_rank_*_model_states.pt files are {tps}, "
                                  "expected mp_rank_00 .. mp_rank_<tp-1>")
    models = [_load_file(os.path.join(ds_dir, f"mp_rank_{t:02d}_model_states.pt")) for t in tps]
    if (models[0].get("ep_tp_layout") or {}).get("expert_tensor_parallel"):
        raise ZeroCheckpointError(f"'{ds_dir}': its experts are sliced over {len(tps)} tensor ranks "
                                  "(MoE enable_expert_tensor_parallelism): consolidating them is not supported; "
                                  "load the checkpoint at the layout that saved it")
    dims, blocks = {}, {}
    for model in models:
        dims.update(model.get("tensor_model_parallel_dims") or {})
        dims.update(model.get("tp_partition_dims") or {})
        blocks.update(model.get("tp_sub_param_sizes") or {})
    sliced = [OrderedDict() for _ in tps]   # a tensor-sliced parameter's slice, per tensor rank
    out = OrderedDict()

    def unsliced(name, shape, t, have, key=None):
        """A tensor not tagged as sliced must have one shape on every tensor rank (else it is a slice whose
        dim the checkpoint does not name: refused, not guessed)."""
        key = name if key is None else key
        if key in have and tuple(have[key].shape) != tuple(shape):
            raise ZeroCheckpointError(f"'{ds_dir}': '{name}' has shape {tuple(shape)} on tensor rank {t} and "
                                      f"{tuple(out[name].shape)} on another, but no tensor-parallel dim is recorded "
                                      "for it (tensor-parallel experts are not consolidated by this script)")

    def put(t, name, value, model_file):
        if name in dims:
            sliced[t][name] = value
            return
        if model_file:   # (an AutoEP expert file holds one expert's rows under the whole tensor's name)
            unsliced(name, value.shape, t, out)
        if t == 0 or name not in out:
            out[name] = value

    experts = _files(ds_dir, "layer_*_expert_*_model_states.pt")
    for t in tps:
        mine = [f for f in experts if f"_mp_rank_{t:02d}_" in os.path.basename(f)]
        module = _without_router_aliases(models[t].get("module") or {}, models[t].get(AUTOEP_LAYERS))
        for i, source in enumerate([module] + [_load_file(f) for f in mine]):
            for name, value in source.items():
                if torch.is_tensor(value):   # (an expert file also holds its layout record)
                    put(t, name, value.float() if value.is_floating_point() else value, i == 0)
    optim = _files(ds_dir, "expp_rank_*_optim_states.pt") + _files(ds_dir, "*zero_pp_rank_*_optim_states.pt")
    trained = {}   # (tensor rank or None, name) -> the fp32 tensor being filled
    for path in optim:
        state = _load_file(path)
        state = state.get("optimizer_state_dict", state)
        if "ds_moe_pieces" not in state:
            raise ZeroCheckpointError(f"'{path}': an MoE checkpoint's optimizer file without ds_moe_pieces "
                                      "(not written by this package); consolidate it with DeepSpeed's own tools")
        found = re.search(r"_mp_rank_(\d+)_", os.path.basename(path))
        t = int(found.group(1)) if found else 0
        for name, start, numel, values in state["ds_moe_pieces"]:
            key = (t if name in dims else None, name)
            unsliced(name, state["shapes"][name], t, trained, key)
            if key not in trained:
                trained[key] = torch.zeros(torch.Size(state["shapes"][name]), dtype=torch.float32)  # host: offline
                (sliced[t] if name in dims else out)[name] = trained[key]
            trained[key].view(-1)[start:start + numel].copy_(values["fp32"])
    for name in dims:
        parts = [s.get(name) for s in sliced]
        if all(p is None for p in parts):
            continue
        if any(p is None for p in parts):
            raise ZeroCheckpointError(f"'{ds_dir}': parameter '{name}' is missing from some tensor-parallel ranks' files")
        out[name] = join_tp_slices([p.contiguous() for p in parts], dims[name], blocks.get(name))
    if exclude_frozen_parameters:
        frozen = set((models[0].get("frozen_param_shapes") or {}))
        out = OrderedDict((k, v) for k, v in out.items() if k not in frozen)
    _info(f"MoE checkpoint: {len(out)} entries, {len({n for _, n in trained})} trained parameters from {len(optim)} "
          f"optimizer files, {len(tps)} tensor-parallel rank(s)")
    return OrderedDict((k, _whole(k, v, v.dtype)) for k, v in out.items())   # what the writers take


def _tp_state_dict(ckpt, tp_dims, exclude_frozen_parameters):
    """AutoTP at ZeRO 1-3: each tensor rank's files hold its slices (`tp_partition_dims` names the dim of
    each sliced parameter); the whole parameter is its slices joined in tensor-rank order, the others
    are equal on every tensor rank (rank 0's are taken)."""
    parts = [ckpt] + [_Checkpoint(ckpt.ds_dir, mp_rank=m) for m in range(1, ckpt.mp_world_size)]
    _info(f"AutoTP checkpoint: {ckpt.mp_world_size} tensor-parallel ranks")
    states = []
    for part in parts:
        state = OrderedDict(_buffers(part))
        if not exclude_frozen_parameters:
            state.update(_frozen(part))
        state.update(_trainable_stage12(part) if part.stage <= 2 else _trainable_stage3(part))
        states.append(state)
    blocks = ckpt.model0.get("tp_sub_param_sizes") or {}
    out = OrderedDict()
    for name, value in states[0].items():
        dim = tp_dims.get(name)
        out[name] = value if dim is None else join_tp_slices([s[name].contiguous() for s in states], dim,
                                                              blocks.get(name))
    for alias, target in (ckpt.model0.get(SHARED_PARAMS) or {}).items():
        if target in out:
            out[alias] = out[target]
    return out


def _layer_tensor_ranks(ds_dir):
    """The tensor-parallel size of a pipeline checkpoint: its `layer_XX-model_YY-model_states.pt` files'
    count of YY (1 with plain `layer_XX-model_states.pt` files)."""
    found = {int(m.group(1)) for m in (re.match(r"^layer_\d+-model_(\d+)-model_states\.pt$", f)
                                       for f in os.listdir(ds_dir)) if m}
    return len(found) or 1


def _pipe_tp_state_dict(parts, tp, exclude_frozen_parameters):
    """3-D (pipeline x tensor) at ZeRO 0-2: model-parallel rank m is stage m // tp's tensor rank m % tp
    (upstream's order). A parameter AutoTP sharded (`tp_partition_dims`, fused ones block by block) or your
    Megatron-style layers tagged `tensor_model_parallel` with a `partition_dim` (`tensor_model_parallel_dims`)
    is its slices joined along that dim in tensor-rank order; the others must be equal on every tensor rank
    (tensor rank 0's are taken)."""
    _info(f"Pipeline x tensor checkpoint: {len(parts) // tp} stages x {tp} tensor-parallel ranks")
    dims, blocks = {}, {}
    for part in parts:   # a dim the ranks' files disagree on (or one without a dim) is not guessed
        for name, dim in (part.model0.get("tensor_model_parallel_dims") or {}).items():
            dims[name] = dim if dims.get(name, dim) == dim else None
    for part in parts:   # AutoTP's own record of its layers
        dims.update(part.model0.get("tp_partition_dims") or {})
        blocks.update(part.model0.get("tp_sub_param_sizes") or {})
    states = [OrderedDict() for _ in range(tp)]
    for m, part in enumerate(parts):
        state = states[m % tp]
        state.update(_layer_buffers(part))
        if not exclude_frozen_parameters:
            state.update(_frozen(part))
        for name, value in _trainable_stage12(part).items():
            state.setdefault(name, value)
    out = OrderedDict()
    for name, value in states[0].items():
        slices = [s.get(name) for s in states]
        if any(v is None for v in slices):
            raise ZeroCheckpointError(f"'{parts[0].ds_dir}': parameter '{name}' is missing from some tensor-parallel "
                                      "ranks' files")
        if name not in dims:
            if len({tuple(v.shape) for v in slices}) > 1:
                shapes = [tuple(v.shape) for v in slices]
                raise ZeroCheckpointError(f"'{parts[0].ds_dir}': parameter '{name}' has a different shape on each "
                                          f"tensor-parallel rank ({shapes}) but is not tagged tensor_model_parallel: "
                                          "the saving model must tag its slices")
            out[name] = value
        elif dims[name] is None:
            raise ZeroCheckpointError(f"'{parts[0].ds_dir}': parameter '{name}' is tagged tensor_model_parallel "
                                      "without a partition_dim (or with a partition_stride other than 1), so its "
                                      "slices cannot be joined: set partition_dim on it (Megatron's "
                                      "set_tensor_model_parallel_attributes) and save again")
        else:
            out[name] = join_tp_slices([v.contiguous() for v in slices], dims[name], blocks.get(name))
    for part in parts:
        for alias, target in (part.model0.get(SHARED_PARAMS) or {}).items():
            if target in out:
                out[alias] = out[target]
    return out


def join_tp_slices(slices, dim, blocks=None):
    """A whole weight from its tensor ranks' slices; a fused one (`blocks`: the sizes of its sub-parameters
    along `dim`) holds a piece of every block per rank, so it is joined block by block. (The runtime's
    AutoTP layers use this one too: this script stands alone, so it holds it.)"""
    if not blocks:
        return torch.cat(slices, dim=dim)
    widths = [b // len(slices) for b in blocks]
    per_rank = [s.split(widths, dim) for s in slices]
    return torch.cat([per_rank[r][j] for j in range(len(blocks)) for r in range(len(slices))], dim=dim)


# =============================================================================== public API


def _resolve_output_dtype(dtype):
    if isinstance(dtype, str):
        name = dtype[6:] if dtype.startswith("torch.") else dtype
        resolved = OUTPUT_DTYPE_NAMES.get(name.lower())
    else:
        resolved = dtype if dtype in OUTPUT_DTYPE_NAMES.values() else None
    if resolved is None:
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return resolved


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """Consolidate a ZeRO 1/2/3 checkpoint into a full fp32 state dict on CPU.

    Args:
        checkpoint_dir: the folder holding ``latest`` and the tag folders (or a tag folder itself).
        tag: the tag folder name, e.g. ``global_step14``; default: the content of ``latest``.
        exclude_frozen_parameters: leave out parameters the optimizer did not own.
        lazy_mode: return ``{name: lazy tensor}`` whose ``.contiguous()`` builds one tensor at a time
            from the memory-mapped files (tied names share one lazy object).

    Returns ``{name: tensor}``: buffers, frozen parameters (in the dtype they were saved in),
    trainable parameters (fp32 master weights) and tied aliases (the same tensor object).
    """
    state = _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    if lazy_mode:
        return state
    built = {}
    out = {}
    for name, lazy in _progress(list(state.items()), desc="Gathering weights", unit="param"):
        t = built.get(id(lazy))
        if t is None:
            t = built[id(lazy)] = lazy.contiguous()
        out[name] = t
    return out


def _parse_size(size):
    if size is None:
        return None
    if isinstance(size, int):
        return size
    s = str(size).strip()
    if s.isdigit():
        return int(s)
    m = re.match(r"^([0-9]*\.?[0-9]+)\s*([A-Za-z]+)$", s)
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"Cannot parse max_shard_size {size!r}: use digits followed by KB, MB, GB or TB "
                         "(like '5GB'), or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _plan_shards(state, out_dtype, max_bytes):
    """Split like huggingface_hub.split_torch_state_dict_into_shards: in key order, a tensor larger
    than the limit gets a shard of its own, tied names follow the shard of their tensor."""
    if max_bytes is None:
        return [list(state)], sum(_nbytes(v, out_dtype(v)) for v in {id(v): v for v in state.values()}.values())
    first_key = {}
    shards, current, current_size, total = [], [], 0, 0
    for name, lazy in state.items():
        if id(lazy) in first_key:
            continue
        first_key[id(lazy)] = name
        size = _nbytes(lazy, out_dtype(lazy))
        total += size
        if size > max_bytes:
            shards.append([name])
            continue
        if current and current_size + size > max_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    where = {n: i for i, shard in enumerate(shards) for n in shard}
    for name, lazy in state.items():
        if first_key[id(lazy)] != name:
            shards[where[first_key[id(lazy)]]].append(name)
    return shards, total


def _nbytes(lazy, dtype):
    return lazy.numel() * torch.empty((), dtype=dtype).element_size()  # host: a size


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the consolidated state dict of a ZeRO checkpoint to ``output_dir``, streaming.

    Files: ``pytorch_model.bin`` (or ``model.safetensors`` with ``safe_serialization``); when the
    total exceeds ``max_shard_size`` (``"5GB"``, ``"500MB"``, bytes as int; None: never shard)
    ``pytorch_model-00001-of-0000N.bin``... plus ``pytorch_model.bin.index.json`` (or
    ``model.safetensors.index.json``) in Hugging Face's format. Floating-point tensors are
    written as ``dtype``; integer/bool buffers keep their dtype. Returns the written file names.
    """
    dtype = _resolve_output_dtype(dtype)
    max_bytes = _parse_size(max_shard_size)
    state = _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)

    def out_dtype(lazy):
        return dtype if lazy.dtype.is_floating_point else lazy.dtype

    shards, total_size = _plan_shards(state, out_dtype, max_bytes)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    stem, ext = os.path.splitext(weights_name)
    if len(shards) == 1:
        file_names = [weights_name]
    else:
        file_names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    os.makedirs(output_dir, exist_ok=True)
    # Each file is written under a scratch folder and moved into place when complete, so an
    # interrupted run never leaves a truncated file with a final name.
    scratch = os.path.join(output_dir, f".zero_to_fp32.partial.{os.getpid()}")
    os.makedirs(scratch, exist_ok=True)
    bar = _progress(total=total_size, desc="Saving checkpoint shards", unit="B", unit_scale=True)
    try:
        for file_name, names in zip(file_names, shards):
            items = [(n, state[n]) for n in names]
            tmp = os.path.join(scratch, file_name)
            if safe_serialization:
                _write_safetensors(tmp, items, out_dtype, bar)
            else:
                _write_torch(tmp, items, out_dtype, bar)
            os.replace(tmp, os.path.join(output_dir, file_name))
            _dbg(f"wrote {file_name} ({len(items)} tensors)")
            del items
            for n in names:  # let the shard's lazy entries (and their pieces) go
                state.pop(n, None)
    finally:
        bar.close()
        for leftover in os.listdir(scratch):
            os.remove(os.path.join(scratch, leftover))
        os.rmdir(scratch)
    index_name = weights_name + ".index.json"
    index_path = os.path.join(output_dir, index_name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {n: f for f, names in zip(file_names, shards) for n in names},
        }
        with open(index_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        file_names = file_names + [index_name]
    elif os.path.exists(index_path):  # a stale index from an earlier sharded run would shadow the new file
        os.remove(index_path)
    _info(f"Saved {', '.join(file_names)} to '{output_dir}'")
    return file_names


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the fp32 consolidated state dict of a ZeRO checkpoint to ``output_dir`` (streaming).

    See :func:`convert_zero_checkpoint_to_state_dict` for the files written.
    """
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                                 max_shard_size=max_shard_size,
                                                 safe_serialization=safe_serialization, tag=tag,
                                                 exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move ``model`` to CPU, load the consolidated fp32 weights into it (strict=False), return it.

    Needs memory for the whole model; the ``zero_to_fp32.py`` command line does not.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


# =============================================================================== writers


class _StorageRef:
    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key, dtype, numel):
        self.key, self.dtype, self.numel = key, dtype, numel


def _rebuild_args(shape, ref):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return (ref, 0, tuple(int(s) for s in shape), tuple(reversed(stride)), False, OrderedDict())


class _TensorRecord:
    """Pickles exactly as torch.save pickles a contiguous CPU tensor, without holding its data."""

    def __init__(self, shape, ref):
        self.shape, self.ref = shape, ref

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_tensor_v2, _rebuild_args(self.shape, self.ref))


def _storage_class(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name = torch.empty(0, dtype=dtype).storage()._pickle_storage_type()  # host: a type name
    return getattr(torch, name)


def _stream_writer_available():
    return (hasattr(torch.serialization, "_open_zipfile_writer") and hasattr(torch._utils, "_rebuild_tensor_v2")
            and hasattr(torch.storage.TypedStorage, "_pickle_storage_type"))


def _write_torch(path, items, out_dtype, bar):
    """A file ``torch.load`` reads as ``{name: tensor}``, one tensor in memory at a time.

    torch.save's layout (data.pkl, then one ``data/<key>`` record per storage) written with
    torch's own zip writer; the pickle only refers to storage keys, so each tensor is built just
    before its record is written and freed right after. Falls back to torch.save of the shard
    when this torch lacks the writer.
    """
    if not _stream_writer_available():
        shard = {}
        built = {}
        for name, lazy in items:
            if id(lazy) not in built:
                built[id(lazy)] = lazy.contiguous(out_dtype(lazy))
                bar.update(built[id(lazy)].nbytes)
            shard[name] = built[id(lazy)]
        torch.save(shard, path)
        return
    records, order, obj = {}, [], {}
    for name, lazy in items:
        rec = records.get(id(lazy))
        if rec is None:
            dtype = out_dtype(lazy)
            rec = records[id(lazy)] = _TensorRecord(lazy.shape, _StorageRef(str(len(order)), dtype, lazy.numel()))
            order.append((rec, lazy, dtype))
        obj[name] = rec

    storage_types = {}

    def persistent_id(o):
        if isinstance(o, _StorageRef):
            st = storage_types.get(o.dtype)
            if st is None:
                st = storage_types[o.dtype] = _storage_class(o.dtype)
            return ("storage", st, o.key, "cpu", o.numel)
        return None

    import io
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.persistent_id = persistent_id
    pickler.dump(obj)
    data = buf.getvalue()
    with torch.serialization._open_zipfile_writer(path) as zf:
        zf.write_record("data.pkl", data, len(data))
        zf.write_record(".format_version", "1", len("1"))
        get_alignment = getattr(torch.serialization, "_get_storage_alignment", None)
        if get_alignment is not None:
            alignment = str(get_alignment())
            zf.write_record(".storage_alignment", alignment, len(alignment))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for rec, lazy, dtype in order:
            t = lazy.contiguous(dtype)
            storage = t.untyped_storage()
            zf.write_record(f"data/{rec.ref.key}", storage, storage.nbytes())
            bar.update(storage.nbytes())
            del t, storage


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _write_bytes(f, t):
    if t.numel() == 0:
        return
    flat = t.reshape(-1).view(torch.uint8)
    if _np is not None:
        f.write(flat.numpy())  # buffer protocol: no copy
    else:  # pragma: no cover - numpy missing
        import ctypes
        f.write(ctypes.string_at(flat.data_ptr(), flat.numel()))


def _write_safetensors(path, items, out_dtype, bar):
    """A safetensors file (8-byte little-endian header length, JSON header, raw data), written one
    tensor at a time. safetensors cannot express tied tensors: an alias is written as a copy."""
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("safetensors output needs a little-endian machine")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, lazy in items:
        dtype = out_dtype(lazy)
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"'{name}' has dtype {dtype}, which safetensors cannot store")
        n = _nbytes(lazy, dtype)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(lazy.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    written = set()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, lazy in items:
            t = lazy.contiguous(out_dtype(lazy))
            _write_bytes(f, t)
            if id(lazy) not in written:
                bar.update(t.nbytes)
                written.add(id(lazy))
            del t


# =============================================================================== command line


def main(argv=None):
    global debug
    parser = argparse.ArgumentParser(
        description="Consolidate a DeepSpeed ZeRO (stage 1/2/3) checkpoint into a full fp32 state dict.")
    parser.add_argument("checkpoint_dir", type=str,
                        help="the checkpoint folder (holding 'latest' and the tag folders), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", type=str,
                        help="folder for the fp32 state_dict files, e.g. path/checkpoint-12-output/")
    parser.add_argument("--max_shard_size", type=str, default="5GB",
                        help="largest size of one output file before sharding, digits followed by a unit "
                        "(KB, MB, GB, TB; decimal, as Hugging Face), default 5GB")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write safetensors (model.safetensors) instead of pickle (pytorch_model.bin)")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="checkpoint tag (a folder name, e.g. global_step1); default: the content of 'latest'")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug")
    args = parser.parse_args(argv)
    debug = args.debug
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                   max_shard_size=args.max_shard_size,
                                                   safe_serialization=args.safe_serialization, tag=args.tag,
                                                   exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ValueError, FileNotFoundError) as exc:
        if debug:
            raise
        print(f"zero_to_fp32: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
