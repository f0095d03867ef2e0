"""Resuming an AutoTP checkpoint at another tensor-parallel size ([Note: moving a checkpoint across TP sizes]).

[Note: moving a checkpoint across TP sizes]
An AutoTP checkpoint holds one file set per saved tensor rank (`mp_rank_XX`), each with that rank's
slices of the partitioned parameters (`tp_partition_dims`: the dim; `tp_sub_param_sizes`: the fused
blocks along it) and a copy of the replicated ones. A run at another TP size (or the same size after a
data-size change, which the reader already handles per file set) reads through `TPReslicedReader`,
which answers the plain reader's questions ("elements [a, b) of parameter `name`, field f") for this
rank's *new* slice:

* the plan is pure and comes from two affine maps ([Note: affine maps] in checkpoint/affine.py): the saved
  layout's (the map the checkpoint records, else derived from its `tp_partition_dims` / `tp_sub_param_sizes`:
  `tp_maps.saved_map`) and this run's (`tp_maps.split_map`, the rule the layers cut by). `affine.plan`
  intersects their blocks: which saved tensor rank's slice, at which offset along the partition dim, lands
  where in the new slice, block by block for fused weights (`plan_segments`, `slice_sources`);
* the executor copies the planned pieces into the new slice, reading the saved slices one at a time:
  `TPReslicedReader.read` asks each saved file set only for the rows that hold the elements asked for
  (a data-parallel piece of the new slice opens only the saved files holding them), `assemble` (module
  tensors) for whole saved slices. Neither holds a parameter's whole value unless the new slice is the
  whole value (TP=1).

Replicated parameters come from tensor rank 0's file set. Everything else (counters, scheduler, loss
scaler, param groups, step) is the same in every file set and is read from rank 0's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...checkpoint import affine, files
from ...checkpoint.affine import ParamAffineMap
from ...checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from ...checkpoint.tp_maps import saved_map, split_map
from ...checkpoint.reader import CheckpointReader, checks_then_copies
from .view import CheckpointView


@dataclass(frozen=True)
class Segment:
    """`length` indices along the partition dim: saved rank `saved_rank`'s slice from `src` -> the new
    slice from `dst`."""
    saved_rank: int
    src: int
    dst: int
    length: int


def slice_sources(size: int, blocks: Sequence[int] | None, saved_tp: int, new_tp: int,
                  new_index: int) -> list[Segment]:
    """The plan for tensor rank `new_index` of `new_tp`: where each piece of its slice of a dim of `size`
    (fused `blocks` along it, else one block) lies in the slices saved by `saved_tp` ranks."""
    return plan_segments(split_map([size], 0, blocks, saved_tp), split_map([size], 0, blocks, new_tp), new_index, 0)


def plan_segments(saved: ParamAffineMap, running: ParamAffineMap, new_index: int, dim: int) -> list[Segment]:
    """`affine.plan` of the two maps as runs along partition dim `dim` (what the executor copies): every planned
    box spans the other dims of both slices whole, else the layout is refused by name."""
    try:
        steps = affine.plan(saved, running, new_index)
    except ValueError as error:
        raise files.CheckpointError(f"cannot move a tensor-parallel slice: {error}") from error
    new_shape = running.shard_shapes[new_index]
    out = []
    for s in steps:
        whole = all(d == dim or (a == b == 0 and n == m == o) for d, (a, b, n, m, o) in
                    enumerate(zip(s.src, s.dst, s.shape, saved.shard_shapes[s.saved_rank], new_shape)))
        if not whole or s.scale != 1.0:
            raise files.CheckpointError(f"cannot move a tensor-parallel slice of {saved.logical_shape}: saved rank "
                                        f"{s.saved_rank}'s block {s} is not a run along partition dim {dim}")
        out.append(Segment(s.saved_rank, s.src[dim], s.dst[dim], s.shape[dim]))
    return out


def assemble(read_slice: Callable[[int], torch.Tensor | None], saved_shape: Sequence[int],
             new_shape: Sequence[int], dim: int, plan: list[Segment]) -> torch.Tensor | None:
    """The new slice from the saved slices `read_slice(rank)` (flat or shaped; None: the field is absent)
    per `plan`, reading one saved slice at a time. None when a saved rank lacks the field."""
    out = torch.empty(tuple(new_shape), dtype=torch.float32)   # host: read from files, copied by the caller
    for rank in sorted({s.saved_rank for s in plan}):
        value = read_slice(rank)
        if value is None:
            return None
        value = value.reshape(tuple(saved_shape))
        for s in plan:
            if s.saved_rank == rank:
                out.narrow(dim, s.dst, s.length).copy_(value.narrow(dim, s.src, s.length))
        del value
    return out


def _resized(shape: Sequence[int], dim: int, num: int, den: int) -> torch.Size:
    dims = list(shape)
    dims[dim] = dims[dim] * num // den
    return torch.Size(dims)


class TPReslicedReader:
    """A CheckpointReader's answers for tensor rank `new_index` of `new_tp`, from the file sets of a
    checkpoint saved at `saved_tp` (see the module note)."""

    def __init__(self, readers: list[CheckpointReader], dims: dict[str, int], blocks: dict[str, list[int]],
                 new_tp: int, new_index: int) -> None:
        self.readers, self.dims, self.blocks = readers, dims, blocks
        self._plans: dict[tuple, list[Segment]] = {}   # (name, saved slice shape): its plan (asked per read)
        self.saved_tp, self.new_tp, self.new_index = len(readers), new_tp, new_index
        self._saved_shapes = {n: s for g in readers[0].groups() for n, s in g}
        self._groups = [[(n, self._new_shape(n, s)) for n, s in g] for g in readers[0].groups()]

    def __getattr__(self, name: str) -> Any:   # path, model_states, common_state, step, fields, has, ...
        return getattr(self.__dict__["readers"][0], name)

    def _new_shape(self, name: str, saved: Sequence[int]) -> torch.Size:
        if name not in self.dims:
            return torch.Size(saved)
        return _resized(saved, self.dims[name], self.saved_tp, self.new_tp)

    def _plan(self, name: str, saved_shape: Sequence[int]) -> list[Segment]:
        """From the saved layout's affine map (recorded in the checkpoint, else derived from its partition dims)
        and this run's (`split_map`, the layers' own rule)."""
        key = (name, tuple(saved_shape))
        if key not in self._plans:
            self._plans[key] = self._planned(name, saved_shape)
        return self._plans[key]

    def _planned(self, name: str, saved_shape: Sequence[int]) -> list[Segment]:
        dim, blocks = self.dims[name], self.blocks.get(name)
        states = getattr(self.readers[0], "model_states", None) or {}
        saved = saved_map(states, name, saved_shape, self.saved_tp, dim, blocks)
        running = split_map(saved.logical_shape, dim, blocks, self.new_tp)
        if running.shard_shapes[self.new_index] != tuple(self._new_shape(name, saved_shape)):
            raise files.CheckpointError(f"{name!r}: the saved slices ({saved.logical_shape} whole) are not an even "
                                        f"split of {tuple(saved_shape)} per tensor rank; cannot move them")
        return plan_segments(saved, running, self.new_index, dim)

    def groups(self) -> list[list[tuple[str, torch.Size]]]:
        return self._groups

    def bind_replicated_names(self, *args: Any, **kwargs: Any) -> None:
        for reader in self.readers:
            reader.bind_replicated_names(*args, **kwargs)
        self._saved_shapes = {n: s for g in self.readers[0].groups() for n, s in g}
        self._groups = [[(n, self._new_shape(n, s)) for n, s in g] for g in self.readers[0].groups()]

    def _reads(self, name: str, start: int, numel: int) -> tuple[tuple[int, ...], int, list[tuple[int, int, int, Any]]]:
        """The plan of reading elements [start, start+numel) of the new slice of `name` (partitioned):
        (shape of the rows read, the flat offset of their first element, [(saved rank, start, numel in its
        slice, the (src, dst, length) runs along the dim to copy from it)]). With the slice viewed as
        [outer, dim, inner], only the outer rows the range spans are read (the dim's own rows when nothing
        precedes it), so a data-parallel piece opens only the saved files holding those rows
        ([Note: reading only what a rank needs] in checkpoint/reader.py)."""
        saved, dim = self._saved_shapes[name], self.dims[name]
        new = self._new_shape(name, saved)
        outer, inner = math.prod(new[:dim]), math.prod(new[dim + 1:])
        plan = self._plan(name, saved)
        if outer == 1:   # the dim leads: its rows [lo, hi)
            lo, hi = start // inner, -(-(start + numel) // inner)
            reads = []
            for seg in plan:
                a, z = max(lo, seg.dst), min(hi, seg.dst + seg.length)
                if a < z:
                    reads.append((seg.saved_rank, (seg.src + a - seg.dst) * inner, (z - a) * inner,
                                  [(0, a - lo, z - a)]))
            return (hi - lo, inner), lo * inner, reads
        new_w, saved_w = new[dim] * inner, saved[dim] * inner   # outer rows [lo, hi) of every saved slice
        lo, hi = start // new_w, -(-(start + numel) // new_w)
        return (hi - lo, new[dim], inner), lo * new_w, [
            (rank, lo * saved_w, (hi - lo) * saved_w, [(g.src, g.dst, g.length) for g in plan if g.saved_rank == rank])
            for rank in sorted({g.saved_rank for g in plan})]

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        """Elements [start, start+numel) of this rank's new slice of `name`, reading only the saved rows
        that hold them (`_reads`); None when a saved rank lacks the field."""
        if name not in self.dims:
            return self.readers[0].read(name, field, start, numel)
        numel = self._new_shape(name, self._saved_shapes[name]).numel() - start if numel is None else numel
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)   # host: an empty read
        shape, base, reads = self._reads(name, start, numel)
        out = torch.empty(shape, dtype=torch.float32)   # host: read from files, copied by the caller
        for rank, first, count, runs in reads:
            value = self.readers[rank].read(name, field, first, count)
            if value is None:
                return None
            value = value.view(-1, *shape[1:]) if len(shape) == 2 else value.view(shape[0], -1, shape[2])
            for src, dst, length in runs:
                if len(shape) == 2:   # rows along the leading dim
                    out[dst:dst + length].copy_(value)
                else:
                    out[:, dst:dst + length].copy_(value[:, src:src + length])
            del value
        return out.view(-1)[start - base:start - base + numel].clone()

    def read_into(self, out: torch.Tensor, name: str, field: str, start: int = 0) -> None:
        """`read` into `out` (1-D): the loader's copy into a master, run in its apply phase."""
        value = self.read(name, field, start, out.numel())
        if value is None:
            raise files.CheckpointError(f"{self.readers[0].path}: no {field!r} for parameter {name!r}")
        out.copy_(value)

    def check(self, name: str, field: str, start: int = 0, numel: int | None = None) -> None:
        """What `read` needs is there (each saved reader checks its rows), without copying."""
        if name not in self.dims:
            _check(self.readers[0], name, field, start, numel)
            return
        numel = self._new_shape(name, self._saved_shapes[name]).numel() - start if numel is None else numel
        for rank, first, count, _ in self._reads(name, start, numel)[2] if numel else ():
            _check(self.readers[rank], name, field, first, count)

    def module_tensor(self, name: str) -> torch.Tensor | None:
        if name not in self.dims:
            return self.readers[0].module_tensor(name)
        first = self.readers[0].module_tensor(name)
        if first is None:
            return None
        saved = first.shape
        del first
        return assemble(lambda r: self.readers[r].module_tensor(name), saved, self._new_shape(name, saved),
                        self.dims[name], self._plan(name, saved))


def _check(reader: Any, name: str, field: str, start: int, numel: int | None) -> None:
    """`reader.check`, or a read (which checks by reading) of a reader that answers `read` only."""
    if checks_then_copies(reader):
        reader.check(name, field, start, numel)
    elif reader.read(name, field, start, numel) is None:
        raise files.CheckpointError(f"{reader.path}: no {field!r} for parameter {name!r} in the checkpoint")


def saved_layout(load_dir: str, tag: str, mp: int = 0, dp: int = 0) -> tuple[str | None, dict | None, str | None]:
    """(tag path, model states, that file's name), or (path, None, None) when there is none to read. The
    states are tensor rank `mp`'s (ZeRO-3: data rank `dp`'s) when that file exists, as the loading rank
    reads them anyway, else tensor rank 0's: every file records the same saved layout."""
    path = files.tag_dir(load_dir, tag)
    if path is None:
        return None, None, None
    for name in dict.fromkeys((files.model_file(mp), files.model_file(mp, zero3_dp_rank=dp), files.model_file(0),
                               files.model_file(0, zero3_dp_rank=0))):
        if os.path.isfile(os.path.join(path, name)):
            return path, files.load_file(os.path.join(path, name)), name
    return path, None, None


def recorded_dims(states: dict, saved_tp: int, own_dims: dict[str, int],
                  own_blocks: dict[str, list[int]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(partition dims, fused blocks) of the tensor slices a checkpoint's model states record: AutoTP's
    `tp_partition_dims` / `tp_sub_param_sizes` and your Megatron-style layers' `tensor_model_parallel_dims`, or
    for DeepSpeed 0.19.8's AutoTP files (which record neither) its name patterns. At saved size 1 nothing was
    sliced: this run's own dims say how to cut."""
    from .writer import MEGATRON_TP_DIMS

    if saved_tp == 1:
        return own_dims, own_blocks
    dims = {**(states.get("tp_partition_dims") or {}),
            **{n: d for n, d in (states.get(MEGATRON_TP_DIMS) or {}).items() if d is not None}}
    if not dims:
        from ...checkpoint.ds_to_universal import _dims_from_patterns

        if not states.get(UNIVERSAL_CHECKPOINT_INFO):
            return {}, {}
        shapes = {n: s for group in states.get("param_shapes") or [] for n, s in group.items()}
        return _dims_from_patterns(states[UNIVERSAL_CHECKPOINT_INFO], [shapes] * saved_tp)[:2]   # even slices
    return dims, dict(states.get("tp_sub_param_sizes") or {})


def resliced_reader(view: CheckpointView, load_dir: str, tag: str, saved_tp: int, states: dict,
                    new_index: int) -> TPReslicedReader:
    """The reader that moves a TP=`saved_tp` checkpoint to this run's tensor-parallel layout."""
    from ...module_inject.layers import tensor_parallel_size
    from .writer import _tp_partition_dims

    new_tp = tensor_parallel_size(view.module)
    path = files.tag_dir(load_dir, tag)
    own_dims, own_blocks = _tp_partition_dims(view.module)
    dims, blocks = recorded_dims(states, saved_tp, own_dims, own_blocks)
    if new_tp > 1 and saved_tp > 1 and (own_dims != dims or own_blocks != blocks):
        raise files.CheckpointError(
            f"{path} was saved at tensor-parallel size {saved_tp} with another partitioning than this run's "
            f"(autotp_size {new_tp}): parameters or partition dims differ, so its slices cannot be moved")
    readers = [CheckpointReader(load_dir, tag, mp_rank=r) for r in range(saved_tp)]
    if readers[0].universal and saved_tp > 1:   # ds_to_universal writes whole values (TP=1): any TP cuts them
        raise files.CheckpointError(f"{path} is a universal checkpoint saved at tensor-parallel size {saved_tp}; "
                                    f"this run has autotp_size {new_tp}: moving universal checkpoints across "
                                    "tensor-parallel sizes is not supported")
    return TPReslicedReader(readers, dims, blocks, new_tp, new_index)


def engine_tensor_layout(view: CheckpointView) -> tuple[int, int, dict[str, int], dict[str, list[int]]]:
    """(tensor-parallel size, this rank's index, {name: partition dim}, {name: fused blocks}) of the running
    engine, from its AutoTP layers or, without them, from its Megatron-style layers' `partition_dim` tags on
    the pipeline grid's slice group or the client mpu's tensor group. A tag without a usable partition dim
    is refused by name (its slice cannot be cut from the whole value)."""
    from ...module_inject.layers import tp_layers
    from .writer import _megatron_partition_dims, _tp_partition_dims

    dims, blocks = _tp_partition_dims(view.module)
    layers = tp_layers(view.module)
    if layers:
        return layers[0].tp_world_size, layers[0].tp_index, dims, blocks
    grid, mpu = view.grid, view.mpu
    if grid is not None:
        size, index = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
    elif mpu is not None and hasattr(mpu, "get_tensor_model_parallel_world_size"):
        size, index = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    else:
        return 1, 0, {}, {}
    tagged = _megatron_partition_dims(view.module)
    unknown = sorted(n for n, d in tagged.items() if d is None)
    if size > 1 and unknown:
        raise files.CheckpointError(f"parameters {unknown} are tagged tensor_model_parallel without a partition_dim "
                                    "(or with a partition_stride other than 1): their slice of a universal "
                                    "checkpoint's whole value cannot be cut; set partition_dim")
    return int(size), int(index), {n: d for n, d in tagged.items() if d is not None}, {}


def universal_cut_reader(view: CheckpointView, reader: Any) -> Any:
    """A universal checkpoint holds whole values (TP=1): at tensor-parallel size > 1 (AutoTP or Megatron-style
    layers, with or without a pipeline) each rank reads its own slice of them through the TP=1 -> TP=t plan,
    and under AutoEP (with or without tensor parallelism: its experts are whole on each rank) each fused expert
    tensor's rows of this rank's experts (dim 0 cut ep_size ways); at TP=1 without AutoEP the reader itself."""
    from .autoep_io import autoep_params

    size, index, dims, blocks = engine_tensor_layout(view)
    cut = reader if size == 1 else TPReslicedReader([reader], dims, blocks, size, index)
    experts = autoep_params(view)
    if not experts:
        return cut
    layers = [layer for _, layer in experts.values()]
    if len({layer.ep_size for layer in layers}) > 1:
        raise files.CheckpointError(f"{reader.path}: loading a universal checkpoint into AutoEP layers of "
                                    f"different ep_size ({sorted({layer.ep_size for layer in layers})}) is not "
                                    "supported")
    first = layers[0]
    if first.ep_size == 1:
        return cut
    return TPReslicedReader([cut], {n: 0 for n in experts}, {}, first.ep_size,
                            first.first_expert // first.num_local_experts)
