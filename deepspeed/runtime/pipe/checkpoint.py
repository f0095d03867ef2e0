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


def saved_stage_count(path: str) -> int:
    found = [re.search(r"mp_rank_(\d+)_model_states\.pt$", f) for f in glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))]
    return len({int(m.group(1)) for m in found if m})


def layer_files(module: Any) -> list[tuple[str, dict]]:
    """(file name, state) of this stage's layers."""
    return [(os.path.basename(module.ckpt_layer_path("", local)), state) for local, state in module.layer_states()]


def module_state_from_layers(module: Any, path: str) -> dict[str, torch.Tensor]:
    """This stage's module state dict (current names) read from the layer files in `path`."""
    state: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in module.named_modules()}
    for local, layer in sorted(module._stateful.items()):
        files = module.ckpt_layer_path_list(path, local)
        if not files:
            continue
        mp = module._grid.get_slice_parallel_rank()
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
    if is_universal(path):   # one mp_rank file per stage, whole values (the loader cuts tensor slices)
        module_state = module_state or None   # no layer files: the module entries of the model states
        if saved == view.num_stages:
            return CheckpointReader(load_dir, tag, mp_rank=view.stage_id, module_state=module_state)
    elif saved == view.num_stages * view.grid.get_slice_parallel_world_size():
        return CheckpointReader(load_dir, tag, mp_rank=view.mp_rank, module_state=module_state)
    readers = []
    for m in range(saved):   # each saved stage's file names only its own parameters: give it its part
        readers.append(CheckpointReader(load_dir, tag, mp_rank=m, module_state=module_state))
    return MergedReader(readers, set(view.module.state_dict().keys()))


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
