"""Pipeline checkpoints in upstream's layout, loadable into any number of stages.

Each stage's data-parallel rank 0 writes `mp_rank_{stage:02d}_model_states.pt` (counters,
scheduler, parameter shapes; `module` is None, as upstream) and one
`layer_{index:02d}[-model_XX]-model_states.pt` per layer; every rank writes its
`zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt` under ZeRO or mixed precision.

[Note: repartitioning at load]
Layers are files named by their global index, so a stage reads the layers it has now whatever
partition wrote them. Parameter names are global too ([Note: parameter names of a stage]), so
the fp32 masters and optimizer state of a parameter are found in whichever stage's files hold
it: with another stage count the loader reads through a MergedReader over every saved stage,
each rank still reading only the slices it owns.

[Note: pipeline x tensor checkpoints at another layout]
With tensor slices (AutoTP in the stages, or Megatron-style layers on the grid's slice groups) the
files are per stage and tensor rank: `mp_rank_{stage * tp + t}` and `layer_LL-model_{t}`. The saved
tensor size is the number of distinct `model_{t}` layer files, the saved stage count the number of
model-states files over it. A stage of another stage count reads, for each saved stage, the files of
its own tensor rank (the saved slices are this rank's slices when the tensor size is unchanged: reading
tensor rank 0's for every rank, as a merge over all model-states files did, loaded other ranks' slices
without an error), or, at another tensor size, every saved tensor rank's files of that stage through
the TP re-slicing reader ([Note: moving a checkpoint across TP sizes]), with the partition dims the
saved files record (`tp_partition_dims`, `tensor_model_parallel_dims`, fused `tp_sub_param_sizes`).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from ...checkpoint.files import CheckpointError, load_file, tag_dir
from ...checkpoint.reader import CheckpointReader, is_universal
from ..checkpoint.view import CheckpointView


_LAYER_SLICE = re.compile(r"layer_\d+-model_(\d+)-model_states\.pt$")   # a layer's file of one tensor rank


def saved_stage_count(path: str) -> int:
    """The number of model-states files (stages x tensor ranks of a pipeline x tensor checkpoint)."""
    found = [re.search(r"mp_rank_(\d+)_model_states\.pt$", f) for f in glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))]
    return len({int(m.group(1)) for m in found if m})


def saved_tensor_size(path: str) -> int:
    """The tensor-parallel size a pipeline checkpoint was saved at: its layer files' tensor ranks."""
    return len({m.group(1) for m in map(_LAYER_SLICE.match, os.listdir(path)) if m}) or 1


def layer_files(module: Any) -> list[tuple[str, dict]]:
    """(file name, state) of this stage's layers."""
    return [(os.path.basename(module.ckpt_layer_path("", local)), state) for local, state in module.layer_states()]


def module_state_from_layers(module: Any, path: str, tensor_rank: int | None = None) -> dict[str, torch.Tensor]:
    """This stage's module state dict (current names) read from the layer files in `path`: tensor rank
    `tensor_rank`'s (default: this rank's slice rank)."""
    state: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in module.named_modules()}
    mp = module._grid.get_slice_parallel_rank() if tensor_rank is None else tensor_rank
    for local, layer in sorted(module._stateful.items()):
        files = module.ckpt_layer_path_list(path, local)
        if not files:
            continue
        values = load_file(files[mp] if len(files) > mp else files[0])
        prefix = names[id(layer)]
        for key, value in values.items():
            state[f"{prefix}.{key}"] = value
    return state


class MergedReader:
    """One view over the per-stage readers of a checkpoint saved with another stage count: each
    parameter is read from the stage files that hold it ([Note: repartitioning at load])."""

    def __init__(self, readers: list[CheckpointReader], wanted: set[str]) -> None:
        self.readers = readers
        self._first = readers[0]
        self._wanted = wanted
        self._owner: dict[str, CheckpointReader] = {}
        self._index()

    def _index(self) -> None:
        self._owner = {}
        for reader in self.readers:
            for name in reader.param_names():
                if name in self._wanted:
                    self._owner.setdefault(name, reader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_first"], name)

    def has(self, name: str) -> bool:
        return name in self._owner

    def read(self, name: str, field: str, start: int = 0, numel: int | None = None) -> torch.Tensor | None:
        if name not in self._owner:
            raise CheckpointError(f"{self._first.path}: no stage's files hold parameter {name!r}")
        return self._owner[name].read(name, field, start, numel)

    def param_names(self) -> list[str]:
        return list(self._owner)

    def groups(self) -> list[list[tuple[str, torch.Size]]]:
        return [[(n, s) for n, s in group if self._owner.get(n) is reader]
                for reader in self.readers for group in reader.groups()]

    def bind_replicated_names(self, *args: Any, **kwargs: Any) -> None:
        for reader in self.readers:   # stage-0 files name their positions only once bound
            reader.bind_replicated_names(*args, **kwargs)
        self._index()


def checkpoint_reader(view: CheckpointView, load_dir: str, tag: str) -> Any:
    """The reader for this stage: its own files when the stage count is unchanged, else merged (the
    pipeline engine's `reader_factory`: [Note: checkpoint view])."""
    path = tag_dir(load_dir, tag)
    if path is None:
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (no directory {tag})")
    module_state = module_state_from_layers(view.module, path)
    saved = saved_stage_count(path)
    wanted = set(view.module.state_dict().keys())
    if is_universal(path):   # one mp_rank file per stage, whole values (the loader cuts tensor slices)
        module_state = module_state or None   # no layer files: the module entries of the model states
        if saved == view.num_stages:
            return CheckpointReader(load_dir, tag, mp_rank=view.stage_id, module_state=module_state)
        return MergedReader([CheckpointReader(load_dir, tag, mp_rank=m, module_state=module_state)
                             for m in range(saved)], wanted)
    tp, tp_rank = view.grid.get_slice_parallel_world_size(), view.grid.get_slice_parallel_rank()
    saved_tp = saved_tensor_size(path)
    stages = saved // saved_tp
    if stages == view.num_stages and saved_tp == tp:
        return CheckpointReader(load_dir, tag, mp_rank=view.mp_rank, module_state=module_state)
    # [Note: pipeline x tensor checkpoints at another layout]: per saved stage, this tensor rank's files
    # (or every saved tensor rank's, re-sliced); each saved stage's files name only its own parameters
    if saved_tp == tp:
        readers = [CheckpointReader(load_dir, tag, mp_rank=s * saved_tp + tp_rank, module_state=module_state)
                   for s in range(stages)]
    else:
        readers = [_resliced_stage(view, load_dir, tag, path, s, saved_tp) for s in range(stages)]
    return MergedReader(readers, wanted)


def _resliced_stage(view: CheckpointView, load_dir: str, tag: str, path: str, stage: int, saved_tp: int) -> Any:
    """Saved stage `stage`'s parameters cut to this rank's tensor slices (the TP re-slicing reader over the
    stage's `saved_tp` file sets, with the partition dims they record)."""
    from ..checkpoint.tp_reslice import TPReslicedReader, engine_tensor_layout, recorded_dims

    tp, index, own_dims, own_blocks = engine_tensor_layout(view)
    readers = [CheckpointReader(load_dir, tag, mp_rank=stage * saved_tp + t,
                                module_state=module_state_from_layers(view.module, path, tensor_rank=t))
               for t in range(saved_tp)]
    dims, blocks = recorded_dims(readers[0].model_states, saved_tp, own_dims, own_blocks)
    return TPReslicedReader(readers, dims, blocks, tp, index)


def load_pipeline_checkpoint_into_sequential(layers: list[Any], load_dir: str, tag: str | None = None) -> torch.nn.Sequential:
    """Build the layers of a PipelineModule (its spec list) as one `nn.Sequential` and load the
    weights of a pipeline checkpoint into it, e.g. for inference without pipeline parallelism.
    Tied layers share one module, as in the pipeline; a TiedLayerSpec with `forward_fn` becomes a
    small module calling `forward_fn(shared, x)`; plain callables are wrapped likewise."""
    from functools import partial

    from ...checkpoint.files import read_latest
    from .module import LayerSpec, TiedLayerSpec

    tag = tag if tag is not None else read_latest(load_dir)
    path = tag_dir(load_dir, str(tag)) if tag is not None else None
    if path is None:
        raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir}")
    tied: dict[str, torch.nn.Module] = {}
    modules: list[torch.nn.Module] = []
    for index, spec in enumerate(layers):
        if isinstance(spec, TiedLayerSpec):
            shared = tied.setdefault(spec.key, spec.build())
            module = shared if spec.forward_fn is None else _Call(partial(spec.forward_fn, shared), shared)
            target = shared
        elif isinstance(spec, LayerSpec):
            module = target = spec.build()
        elif isinstance(spec, torch.nn.Module):
            module = target = spec
        else:
            module, target = _Call(spec), None
        files = sorted(glob.glob(os.path.join(path, f"layer_{index:02d}-*model_states.pt")))
        if target is not None and files:
            target.load_state_dict(load_file(files[0]))
        modules.append(module)
    return torch.nn.Sequential(*modules)


class _Call(torch.nn.Module):
    def __init__(self, fn: Any, shared: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.fn = fn
        if shared is not None:
            self.shared = shared   # registered, so its parameters are the Sequential's too

    def forward(self, x: Any) -> Any:
        return self.fn(x)
