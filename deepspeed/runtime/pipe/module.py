"""PipelineModule: a model given as a sequence of layers, of which each rank builds its stage.

A spec records how to build a layer without building it, so a pipeline stage constructs only
its own layers (a model too large for one process never exists whole). Layers are partitioned
into contiguous stages ("parameters", "uniform", "type:<regex>" or explicit boundaries); the
forward of a stage runs its layers in order, optionally under activation checkpointing every
`activation_checkpoint_interval` layers. Tied layers (TiedLayerSpec with one key) share one
module per stage; their gradients are summed over the stages that hold them.

[Note: parameter names of a stage]
A layer's parameters are named by its global index (`3.weight` for layer 3), tied modules
`tied_modules.<key>.<name>`, as upstream, so a stage's state_dict keys do not depend on the
partition and checkpoints are one file per layer (`layer_03-model_states.pt`).
"""

from __future__ import annotations

import glob
import os
import re
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ... import comm as ds_comm
from ...utils.logging import log_dist
from ..activation_checkpointing import checkpointing
from ..layer_partition import partition_balanced, partition_uniform
from .topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class LayerSpec:
    """`LayerSpec(torch.nn.Linear, 4, 8)` builds `torch.nn.Linear(4, 8)` when `build()` is called."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = ds_comm.get_rank() if ds_comm.is_initialized() else -1

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        if log:
            log_dist(f"RANK={self.global_rank} building {self!r}", ranks=[-1])
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters (`tied_weight_attr`) are shared by every spec with the same `key`;
    `forward_fn(module, inputs)` replaces the module's forward where given (e.g. an embedding
    reused as the output projection)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def set_random_seed(seed: int) -> None:
    """Seed python, numpy (when installed) and torch, as upstream's runtime.utils.set_random_seed."""
    import random

    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_layer_params(specs: Sequence[Any]) -> list[int]:
    """Trainable parameters per layer; specs are built on the meta device (no memory, no RNG use)."""
    counts = []
    for spec in specs:
        if isinstance(spec, LayerSpec):
            with torch.device("meta"):
                module = spec.build()
        elif isinstance(spec, nn.Module):
            module = spec
        else:
            counts.append(0)
            continue
        counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
    return counts


def partition_layers(specs: Sequence[Any], num_stages: int, method: Any) -> list[int]:
    """Stage boundaries (length num_stages + 1) for `method`; pure."""
    if isinstance(method, (list, tuple)):
        parts = [int(b) for b in method]
        if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != len(specs) or parts != sorted(parts):
            raise ValueError(f"PipelineModule partition_method {list(method)}: explicit boundaries must be "
                             f"{num_stages + 1} non-decreasing layer indices from 0 to {len(specs)}")
        return parts
    if not isinstance(method, str):
        raise ValueError(f"PipelineModule partition_method must be a string or a list of boundaries, got {method!r}")
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(num_items=len(specs), num_parts=num_stages)
    if lowered == "parameters":
        return partition_balanced(weights=count_layer_params(specs), num_parts=num_stages)
    if lowered.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(layer_name(s)) else 0 for s in specs]
        if not any(weights):
            raise RuntimeError(f"Partitioning '{method.split(':', 1)[1]}' found no valid layers to partition "
                               f"(layer types: {sorted({layer_name(s) for s in specs})})")
        return partition_balanced(weights=weights, num_parts=num_stages)
    raise NotImplementedError(f"Partitioning method {method} not implemented (use 'parameters', 'uniform', "
                              "'type:<regex>' or a list of stage boundaries)")


class PipelineModule(nn.Module):
    """A sequence of layers split into pipeline stages; this rank builds and runs its stage."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: Any = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpointing.checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule: must provide num_stages or topology")
        if not ds_comm.is_initialized():
            raise RuntimeError("PipelineModule needs torch.distributed initialized first: call "
                               "deepspeed.init_distributed() before building the model")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ValueError(f"PipelineModule checkpointable_layers must be a list of class names, "
                             f"got {checkpointable_layers!r}")
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if topology is not None:
            self._topo = topology
            self.num_stages = topology.get_dim("pipe")
        else:
            if num_stages < 1 or self.world_size % num_stages != 0:
                raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size ({self.world_size})")
            self.num_stages = num_stages
            self._topo = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self._num_layers < self.num_stages:
            raise ValueError(f"PipelineModule: {self._num_layers} layers cannot fill {self.num_stages} stages")
        self.parts = partition_layers(self._layer_specs, self.num_stages, partition_method)
        self._set_bounds(self.parts[self.stage_id], self.parts[self.stage_id + 1])
        if self.global_rank == 0:
            log_dist(f"Pipeline partition ({partition_method}): " + "; ".join(
                f"stage {s}: layers {self.parts[s]}-{self.parts[s + 1] - 1}" for s in range(self.num_stages)),
                ranks=[0])
        self.forward_funcs: list[Any] = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._stateful: dict[int, nn.Module] = {}   # local layer index -> module saved as its layer file
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self._build()
        self._precompute_checkpointable_values()
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # --- construction ---------------------------------------------------------------------
    def _build(self) -> None:
        for local, spec in enumerate(self._layer_specs[self._local_start:self._local_stop]):
            index = local + self._local_start
            if self.seed_layers:
                (self.seed_fn or set_random_seed)(self.base_seed + index)
            if isinstance(spec, PipelineModule):
                raise NotImplementedError("a PipelineModule cannot be a layer of another PipelineModule")
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                self.forward_funcs.append(module if spec.forward_fn is None else partial(spec.forward_fn, module))
                self._stateful[local] = module
            elif isinstance(spec, (LayerSpec, nn.Module)):
                module = spec.build() if isinstance(spec, LayerSpec) else spec
                self.forward_funcs.append(module)
                self.fwd_map[str(index)] = len(self.forward_funcs) - 1
                self.add_module(str(index), module)
                self._stateful[local] = module
            elif callable(spec):
                self.forward_funcs.append(spec)
            else:
                raise ValueError(f"PipelineModule layer {index} is {spec!r}: layers must be LayerSpec, TiedLayerSpec, "
                                 "nn.Module or a callable")
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def _index_tied_modules(self) -> dict[str, dict]:
        """One group per tied key and (data, model) coordinate: the ranks of the stages holding it.
        Every rank creates every group in the same (sorted) order."""
        comms: dict[str, dict] = {}
        if self._topo.get_dim("pipe") <= 1:
            return comms
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        slices = self._grid.get_slice_parallel_world_size()
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            lists = []
            for dp in range(self._grid.data_parallel_size):
                for mp in range(slices):
                    extra = {"data": dp, "model": mp} if slices > 1 else {"data": dp}
                    if "data" not in self._topo.axes:
                        extra.pop("data")
                    lists.append([self._grid.stage_to_global(stage_id=s, **extra) for s in stages])
            mine = self._grid.mesh.rank_groups(f"tied:{key}", lists)   # the grid's mesh owns every group
            if mine is not None:
                ranks, group = mine
                comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                              "module": self.tied_modules[key]}
                if self.global_rank != ranks[0]:   # counted once by gradient norms
                    for p in self.tied_modules[key].parameters():
                        p.ds_pipe_replicated = True
        return comms

    @staticmethod
    def _recursive_getattr(module: nn.Module, attr_name: str) -> torch.Tensor:
        for name in attr_name.split("."):
            module = getattr(module, name)
        return module  # type: ignore[return-value]

    def tied_weights(self) -> list[tuple[str, torch.Tensor, dict]]:
        """(key, weight, comm) for every tied weight this stage holds, in key order."""
        return [(key, self._recursive_getattr(comm["module"], attr), comm)
                for key, comm in self.tied_comms.items() for attr in comm["weight_attr"]]

    def _synchronize_tied_weights(self) -> None:
        """Every stage holding a tied module starts from the first such stage's weights."""
        for _, weight, comm in self.tied_weights():
            ds_comm.broadcast(weight.data, src=min(comm["ranks"]), group=comm["group"])

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of tied weights over the stages that hold them (`.grad` tensors)."""
        for _, weight, comm in self.tied_weights():
            if weight.grad is not None:
                ds_comm.all_reduce(weight.grad, group=comm["group"])

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(weight, comm["group"]) for _, weight, comm in self.tied_weights()]

    # --- forward ----------------------------------------------------------------------------
    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers; each checkpointed block takes and returns tuples of tensors."""
        self.micro_offset += 1
        offset = self.micro_offset + 1

        def run(start: int, end: int) -> Callable:
            def block(*inputs: Any) -> Any:
                x = inputs[0] if len(inputs) == 1 else inputs
                for local, layer in enumerate(self.forward_funcs[start:end]):
                    self.curr_layer = start + local + self._local_start
                    if self.seed_layers:
                        (self.seed_fn or set_random_seed)(self.base_seed * offset + self.curr_layer)
                    x = layer(x)
                return x
            return block

        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return run(0, count)(forward_input)
        if self.is_checkpointable_results_interval != interval:   # the attribute was assigned directly
            self._precompute_checkpointable_values()
        x = forward_input
        for block, start in enumerate(range(0, count, interval)):
            end = min(start + interval, count)
            args = x if isinstance(x, tuple) else (x,)
            if self.is_checkpointable_results[block]:
                x = self.activation_checkpoint_func(run(start, end), *args)
            else:
                x = run(start, end)(*args)
        return x

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def _precompute_checkpointable_values(self) -> None:
        """Which blocks of `activation_checkpoint_interval` layers forward() checkpoints (upstream's
        cached list; recomputed whenever the interval changes)."""
        interval = self.activation_checkpoint_interval
        count = len(self.forward_funcs)
        self.is_checkpointable_results = [self._is_checkpointable(self.forward_funcs[start:start + interval])
                                          for start in range(0, count, interval)] if interval > 0 else []
        self.is_checkpointable_results_interval = interval

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    # --- layout -----------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside 0..{self._num_layers - 1}")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"layer {layer_idx} is owned by no stage (parts={self.parts})")

    def _set_bounds(self, start: int | None = None, stop: int | None = None) -> None:
        self._local_start = start or 0
        self._local_stop = stop

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def get_additional_losses(self) -> dict | None:
        return None

    # --- checkpoint files ([Note: parameter names of a stage]) ---------------------------------
    def ckpt_prefix(self, checkpoints_path: str, tag: Any) -> str:
        name = "module"
        coord = self._topo.get_coord(self.global_rank)
        for axis in self._topo.get_axis_names():
            if axis != "data":
                name += f"-{axis}_{getattr(coord, axis):02d}"
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        path = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        pattern = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}-*model_states.pt")
        return sorted(glob.glob(pattern))

    def layer_states(self, exclude_frozen_params: bool = False) -> list[tuple[int, dict]]:
        """(local layer index, state dict with tensors that own their storage) of this stage."""
        out = []
        for local, module in sorted(self._stateful.items()):
            if isinstance(self.forward_funcs[local], partial) and any(
                    m is module for i, m in self._stateful.items() if i < local):
                continue   # a tied module used again: saved at its first use on this stage
            state = module.state_dict()
            if exclude_frozen_params:
                frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            out.append((local, {k: v.detach().clone().cpu() for k, v in state.items()}))
        return out

    def save_state_dict(self, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False) -> None:
        """Write this stage's layer files (data-parallel rank 0 only: replicas hold the same)."""
        if self._grid.data_parallel_id != 0:
            return
        os.makedirs(save_dir, exist_ok=True)
        for local, state in self.layer_states(exclude_frozen_params):
            path = self.ckpt_layer_path(save_dir, local)
            if checkpoint_engine is not None:
                checkpoint_engine.save(state, path)
            else:
                torch.save(state, path)

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True) -> None:
        """Load this stage's layers from their files (any saved partition: files are per layer)."""
        for local, module in sorted(self._stateful.items()):
            files = self.ckpt_layer_path_list(load_dir, local)
            if not files:
                if isinstance(self.forward_funcs[local], partial):
                    continue   # a tied module's forward_fn use; its weights come with another layer
                raise FileNotFoundError(f"no checkpoint file for pipeline layer {local + self._local_start} in "
                                        f"{load_dir} (expected {self.ckpt_layer_path(load_dir, local)})")
            mp_rank = self._grid.get_slice_parallel_rank()
            path = files[mp_rank] if len(files) > mp_rank else files[0]
            state = checkpoint_engine.load(path, map_location="cpu") if checkpoint_engine is not None \
                else torch.load(path, map_location="cpu", weights_only=True)
            module.load_state_dict(state, strict=strict)
        self._synchronize_tied_weights()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        for index, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[index] = torch.compile(layer, *args, **kwargs)
