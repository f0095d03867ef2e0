"""Tensor-parallel Linear layers (AutoTP), at upstream's import path.

[Note: tensor-parallel Linear pair]
A column-parallel layer (`LinearLayer`) holds rows [r*n/tp, (r+1)*n/tp) of the weight (and bias): its
output is this rank's slice of the features. A row-parallel layer (`LinearAllreduce`) holds the matching
columns of its weight: its partial products are summed over the tensor-parallel group, then the (whole,
replicated) bias is added. Megatron's f/g pair makes the two differentiable: the column layer's input
passes `copy_to_tensor_parallel` (identity forward, all-reduce of the input gradient backward, since each
rank's slice contributes part of it) and the row layer's output `reduce_from_tensor_parallel` (all-reduce
forward, identity backward). So every rank sees the same activations outside the pair, replicated
parameters (norms, embeddings, row biases) get identical gradients on every TP rank, and sharded ones
get their slice of the full gradient. Collectives go through deepspeed.comm.

The parameters stay the module's own Parameter objects (their `.data` becomes the slice), so optimizer
parameter lists made before sharding stay valid. A sharded parameter carries upstream's Megatron-style
flag `tensor_model_parallel = True` (clients and upstream's norm helpers read it).

[Note: one input-gradient all-reduce per shared input]
Column layers that read the same tensor (q/k/v projections of one attention input, gate/up of one MLP
input) would each all-reduce their own part of that input's gradient: 3x and 2x the bytes Megatron's
fused QKV layer sends. The first column layer to see an input hangs its `copy_to_tensor_parallel` result
on the input (keyed by group and grad mode) and the others reuse it, so autograd sums their gradients
into that one node and its backward all-reduces the sum once. The result aliases the input (the same
storage and version counter) and dies with it; a recomputed forward (activation checkpointing) makes new
inputs and so new nodes. Summing before rather than after the all-reduce changes rounding only.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from ..checkpoint.affine import ParamAffineMap, replicated_map
from ..checkpoint.constants import (AFFINE_MAP, AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, ORIGINAL_VOCAB_SIZE,
                                    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS,
                                    SUB_PARAM_SHARD_WIDTHS, TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO,
                                    UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                                    VOCABULARY_PARAMETER_PATTERNS)
from .. import comm as ds_comm

DS_TENSOR_MODEL_PARALLEL = "tensor_model_parallel"
DS_IS_REPLACED_MODULE = "ds_is_replaced_module"


_AUTOTP_TRAINING = False   # upstream's AutoTP mode switch: tp_model_init turns it on


def set_autotp_mode(training: bool = False) -> None:
    """Upstream's switch between AutoTP for inference and for training (tp_model_init sets training)."""
    global _AUTOTP_TRAINING
    _AUTOTP_TRAINING = bool(training)


def is_autotp_training_mode() -> bool:
    return _AUTOTP_TRAINING


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a parameter sharded over the tensor-parallel group."""
    return bool(getattr(param, DS_TENSOR_MODEL_PARALLEL, False))


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x.detach()   # same storage and version counter, but not a view holding `x` (no cycle
                            # when `x` holds this result: [Note: one input-gradient all-reduce ...])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        ds_comm.all_reduce(grad, group=ctx.group)
        return None, grad


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, group: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous().clone()
        ds_comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return None, grad


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        ctx.rank = ds_comm.get_rank(group)
        pieces = [torch.empty_like(x) for _ in range(ds_comm.get_world_size(group))]
        ds_comm.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return None, grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous()


def copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(group, x)


def shared_copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`copy_to_tensor_parallel` once per input tensor, group and grad mode ([Note: one input-gradient
    all-reduce per shared input])."""
    if torch.compiler.is_compiling():
        return _CopyToTP.apply(group, x)
    key = (id(group), torch.is_grad_enabled())
    cached = getattr(x, "_ds_tp_input_copy", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    out = _CopyToTP.apply(group, x)
    try:
        x._ds_tp_input_copy = (key, out)
    except (AttributeError, RuntimeError):   # a tensor subclass that takes no attributes: no sharing
        pass
    return out


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(group, x)


def gather_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherFromTP.apply(group, x)


class TensorParallel_Layer(nn.Module):
    """Base of the tensor-parallel layers: the group, this rank's index in it, and the dim it splits."""

    partition_dim: int = 0   # of the weight: 0 for column-parallel, 1 for row-parallel
    tp_overlap_comm: bool = False   # upstream's switch; accepted, the all-reduce is not overlapped here

    def __init__(self, mp_group: Any, name: str | None = None, sub_sizes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.sub_sizes = tuple(sub_sizes) if sub_sizes else None   # [Note: fused sub-parameters] (autotp_config)
        self.mp_group = mp_group
        self.tp_world_size = ds_comm.get_world_size(mp_group) if mp_group is not None else 1
        self.tp_index = ds_comm.get_rank(mp_group) if mp_group is not None else 0
        self.world_size, self.rank = self.tp_world_size, self.tp_index   # upstream's older names
        self.name = name
        self.support_training = True

    def _blocks(self, dim: int) -> tuple[int, ...] | None:
        return self.sub_sizes if dim == self.partition_dim else None

    def _slice(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice: of each fused block in turn, or of the whole dim when not fused."""
        blocks = full.split(list(self._blocks(dim) or (full.shape[dim],)), dim)
        widths = [b.shape[dim] // self.tp_world_size for b in blocks]
        pieces = [b.narrow(dim, self.tp_index * w, w) for b, w in zip(blocks, widths)]
        return torch.cat(pieces, dim).detach().clone().contiguous()

    def join(self, slices: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole tensor from every rank's slice, in rank order (the inverse of `_slice`)."""
        from ..utils.zero_to_fp32 import join_tp_slices

        return join_tp_slices(slices, dim, self._blocks(dim))

    def _mark(self, param: torch.Tensor) -> None:
        setattr(param, DS_TENSOR_MODEL_PARALLEL, True)
        setattr(param, DS_IS_REPLACED_MODULE, True)
        # upstream hangs its layer's gather/re-cut on each sharded parameter (`param.gather_params([param])`)
        param.gather_params, param._tp_partition = self.gather_params, self._tp_partition

    @torch.no_grad()
    def gather_params(self, params_list: Iterable[torch.Tensor | None]) -> None:
        """Upstream's: each given sharded parameter of this layer becomes whole in place (collective over
        the TP group); `_tp_partition` cuts its slice again. Other parameters (None, replicated, another
        layer's, already whole) are left alone."""
        dims = dict((id(p), d) for p, d in self.sharded_params())
        shards = self.__dict__.setdefault("_tp_shards", {})
        for p in params_list:
            if p is not None and id(p) in dims and id(p) not in shards:
                shards[id(p)] = p.data
                p.data = self.full_param(p, dims[id(p)])

    @torch.no_grad()
    def _tp_partition(self, params_list: Iterable[torch.Tensor | None]) -> None:
        """This rank's slice again, cut from the (possibly updated) whole value and written back into the
        parameter's original storage (ZeRO-1/2 hold parameters as views of their flat buffers)."""
        dims = dict((id(p), d) for p, d in self.sharded_params())
        shards = self.__dict__.get("_tp_shards", {})
        for p in params_list:
            if p is not None and id(p) in shards:
                shard = shards.pop(id(p))
                shard.copy_(self._slice(p.data, dims[id(p)]))
                p.data = shard

    def sharded_params(self) -> list[tuple[nn.Parameter, int]]:
        """(parameter, the dim it is split on) for each sharded parameter."""
        raise NotImplementedError

    def affine_map(self, param: torch.Tensor, dim: int) -> ParamAffineMap:
        """Where each tensor rank's slice of `param` (split on `dim`) sits in the whole tensor, as `_slice`
        cuts it ([Note: affine maps] in checkpoint/affine.py)."""
        from ..checkpoint.tp_maps import split_map

        full = list(param.shape)
        full[dim] *= self.tp_world_size
        return split_map(full, dim, self._blocks(dim), self.tp_world_size)

    @torch.no_grad()
    def full_param(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole parameter, all-gathered over the group (collective)."""
        if self.tp_world_size == 1:
            return param.data.clone()
        pieces = [torch.empty_like(param.data) for _ in range(self.tp_world_size)]
        ds_comm.all_gather(pieces, param.data.contiguous(), group=self.mp_group)
        return self.join(pieces, dim)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, " \
               f"tp_world_size={self.tp_world_size}, tp_index={self.tp_index}"


class LinearLayer(TensorParallel_Layer):
    """Column-parallel Linear ([Note: tensor-parallel Linear pair]); `gather_output` all-gathers the
    features so the layer's output is whole (Hugging Face's `colwise_gather_output`)."""

    partition_dim = 0

    def __init__(self, module: nn.Linear, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, name: str | None = None, sub_sizes: tuple[int, ...] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(mp_group, name, sub_sizes)
        self.weight, self.bias = module.weight, module.bias
        self.in_features, self.out_features = module.in_features, module.out_features
        self.gather_output = gather_output
        if not skip_partition and self.tp_world_size > 1:
            self.weight.data = self._slice(self.weight.data, 0)
            if self.bias is not None:
                self.bias.data = self._slice(self.bias.data, 0)
        self._mark(self.weight)
        if self.bias is not None:
            self._mark(self.bias)

    def sharded_params(self) -> list[tuple[nn.Parameter, int]]:
        return [(p, 0) for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_world_size > 1:
            x = shared_copy_to_tensor_parallel(x, self.mp_group)
        out = nn.functional.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_world_size > 1:
            out = gather_from_tensor_parallel(out, self.mp_group)
        return out


class LinearAllreduce(TensorParallel_Layer):
    """Row-parallel Linear ([Note: tensor-parallel Linear pair]): partial products all-reduced over the
    group, then the replicated bias added."""

    partition_dim = 1

    def __init__(self, module: nn.Linear, mp_group: Any = None, skip_partition: bool = False,
                 name: str | None = None, sub_sizes: tuple[int, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(mp_group, name, sub_sizes)
        self.weight, self.bias = module.weight, module.bias
        self.in_features, self.out_features = module.in_features, module.out_features
        if not skip_partition and self.tp_world_size > 1:
            self.weight.data = self._slice(self.weight.data, 1)
        self._mark(self.weight)

    def sharded_params(self) -> list[tuple[nn.Parameter, int]]:
        return [(self.weight, 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        if self.tp_world_size > 1:
            out = reduce_from_tensor_parallel(out, self.mp_group)
        return out + self.bias if self.bias is not None else out


class SubParamLinearLayer(LinearLayer):
    """A column layer over a fused weight (`shape` in a layer spec): each block split on its own."""


class SubParamLinearAllreduce(LinearAllreduce):
    """A row layer over a weight fused along its input features."""


class fused_LinearLayer(SubParamLinearLayer):   # noqa: N801 (upstream's name): fused q/k/v, equal blocks
    pass


class GateUpPack_LinearLayer(SubParamLinearLayer):   # noqa: N801 (upstream's name): [gate; up]
    pass


def tp_layers(module: nn.Module) -> list[TensorParallel_Layer]:
    return [m for m in module.modules() if isinstance(m, TensorParallel_Layer)]


def tensor_parallel_size(module: nn.Module) -> int:
    """The TP size the module was sharded for (1 when it holds no tensor-parallel layer)."""
    sizes = {layer.tp_world_size for layer in tp_layers(module)}
    if len(sizes) > 1:
        raise ValueError(f"the model holds tensor-parallel layers of different sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 1


class GatherReplacedLayerParams:
    """Context manager: inside it the given parameters of AutoTP layers are whole (all-gathered over
    the tensor-parallel group); on exit each is this rank's slice again, cut from the whole value
    (so weights loaded inside the block are kept) and written back into the parameter's original
    storage (ZeRO-1/2 hold parameters as views of their flat buffers). Parameters of other layers
    are left alone; collective over the tensor-parallel group (every TP rank enters it)."""

    def __init__(self, params: Iterable[torch.Tensor] | torch.Tensor, module: nn.Module, enabled: bool = True) -> None:
        self.module = module
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = {}
        if enabled:
            for layer in tp_layers(module):
                for p, _ in layer.sharded_params():
                    owners[id(p)] = layer
        self._targets = [(p, owners[id(p)]) for p in self.params if id(p) in owners]
        self.enabled = enabled and bool(self._targets)

    def __enter__(self) -> None:
        if self.enabled:
            for p, layer in self._targets:
                layer.gather_params([p])

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            for p, layer in self._targets:
                layer._tp_partition([p])


def gather_full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every AutoTP parameter whole (collective over the TP group)."""
    full: dict[int, torch.Tensor] = {}
    for layer in tp_layers(module):
        for p, dim in layer.sharded_params():
            full[id(p)] = layer.full_param(p, dim)
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    state = module.state_dict()
    by_name = {names[i]: t for i, t in full.items() if i in names}
    return {k: by_name.get(k, v) for k, v in state.items()}


# [Universal-checkpoint info]
# Upstream's `model.universal_checkpoint_info` for an AutoTP model, in its schema (version 0.4): the
# parameter patterns of upstream's older converter (row-parallel, TP-replicated, vocabulary, fused blocks
# with their per-rank `sub_param_shard_widths`) and, under `affine_map`, each parameter's affine map
# ([Note: affine maps] in checkpoint/affine.py): which block of the whole tensor every tensor rank's shard
# holds, replicated parameters (norms, embeddings, a row layer's bias) as one piece on every rank. The maps
# are the description: our ds_to_universal and TP re-slice read them, and upstream 0.19.8's converter
# prefers them over the patterns. Every model-states file records the info (runtime/checkpoint/writer.py).


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """The conversion description of `model`'s parameters, each under its first (canonical) name."""
    from ..checkpoint.tp_maps import published

    split = {id(p): (layer, dim) for layer in tp_layers(model) for p, dim in layer.sharded_params()}
    tp = tensor_parallel_size(model)
    rows, replicated, vocabulary, fused, widths, maps = [], [], [], [], {}, {}
    vocab_size = None
    for name, param in model.named_parameters():   # tied parameters: the first name only
        pattern = rf"^{re.escape(name)}$"
        if id(param) not in split:
            replicated.append(pattern)
            maps[pattern] = replicated_map(param.shape, tp)
            continue
        layer, dim = split[id(param)]
        maps[pattern] = layer.affine_map(param, dim)
        if dim == 1:
            rows.append(pattern)
        elif param.dim() == 2 and ("embed" in name or "lm_head" in name):
            vocabulary.append(pattern)
            vocab_size = vocab_size or param.shape[0] * layer.tp_world_size
        blocks = layer._blocks(dim)
        if blocks:
            shape: list[Any] = [-1] * param.dim()
            shape[dim] = tuple(blocks)
            fused.append({"patterns": [pattern], "shape": shape, "partition_dim": dim})
            widths[pattern] = [[b // layer.tp_world_size] * layer.tp_world_size for b in blocks]
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(rows),
            TP_REPLICATED_PARAMETER_PATTERNS: sorted(replicated),
            VOCABULARY_PARAMETER_PATTERNS: sorted(vocabulary),
            PARAMETER_WITH_SUB_PARAMS: fused,
            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {},
            AFFINE_MAP: published(maps)}
    if widths:
        info[SUB_PARAM_SHARD_WIDTHS] = widths
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


def attach_universal_checkpoint_info(model: nn.Module) -> None:
    """Set `model.universal_checkpoint_info` (upstream's attribute) after AutoTP sharded it."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(model))
