"""`deepspeed.initialize` and `deepspeed.add_config_arguments`."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from ..utils.logging import log_dist
from ..version import __version__


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed`, `--deepspeed_config` (and the deprecated `--deepscale*`) to `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def _config_from_args(args: Any, config: Any, config_params: Any) -> Any:
    """Pick the one config source among `config`, `config_params` and `args.deepspeed_config`."""
    if config is None and config_params is not None:
        config = config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("Both --deepscale_config (deprecated) and --deepspeed_config were given; use only "
                             "--deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("deepspeed.initialize: a config was given both as --deepspeed_config "
                             f"({from_args!r}) and as the `config` argument; pass only one")
        config = from_args
    if config is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config; pass `config=` (dict or JSON path) or "
                         "--deepspeed_config on the command line (see deepspeed.add_config_arguments)")
    return config


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple:
    """Build the training engine.

    Returns `(engine, optimizer, training_dataloader, lr_scheduler)`: the engine wraps `model`;
    `optimizer` is the client's or the config's (None when neither), `training_dataloader` is a
    DeepSpeedDataLoader over `training_data` (or None), `lr_scheduler` the client's or the
    config's (or None). The config is validated on every rank, and agreed across ranks, before any
    collective that depends on it.
    """
    from .. import comm as ds_comm
    from .agreement import agree_config
    from .config import DeepSpeedConfig, load_config_dict
    from .engine import DeepSpeedEngine

    if model is None:
        from .errors import ArgumentError

        raise ArgumentError("deepspeed.initialize requires a model (got model=None)")
    mesh_sp = _mesh_param_sequence(mesh_param)
    from .checkpoint.save_job import wait_all_local

    wait_all_local()  # an earlier engine's background save: its files are complete before a new engine reads any
    engine_class = DeepSpeedEngine
    if _is_pipeline_module(model):
        from .pipe.engine import PipelineEngine

        if mpu is not None:
            raise ValueError("deepspeed.initialize: do not pass `mpu` with a PipelineModule (its topology "
                             "defines the groups)")
        mpu, engine_class = model.mpu(), PipelineEngine

    def build() -> Any:
        raw = load_config_dict(_config_from_args(args, config, config_params))
        if mesh_sp is not None:
            raw = {**raw, "sequence_parallel_size": mesh_sp}
        world_size = _data_parallel_size(raw, mpu, ds_comm.get_world_size(), model)
        raw = _tp_counted_batch(raw, ds_comm.get_world_size(), world_size)
        return DeepSpeedConfig(raw, world_size=world_size)

    # No process group yet: validate first, so a bad config raises before the rendezvous. With one,
    # loading and validating run inside the agreement: a bad file on one rank fails every rank.
    config_or_build = build if ds_comm.is_initialized() else build()
    ds_comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required,
                          verbose=False)
    # Every rank the same resolved config, or every rank the same error ([Note: cross-rank config agreement]).
    config_class = agree_config(config_or_build, "deepspeed.initialize")
    raw = config_class.raw
    set_optimizer_flags(config_class, model)
    log_dist(f"DeepSpeed info: version={__version__} (pure-Python)", ranks=[0])
    engine = engine_class(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                          dist_init_required=dist_init_required, collate_fn=collate_fn, config=raw,
                          config_class=config_class)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def set_optimizer_flags(config_class: Any, model: torch.nn.Module) -> None:
    """`"optimizer": {"type": "Muon"}`: tag each parameter `use_muon` by upstream's rule (matrices,
    ndim >= 2 as layers (ZeRO-3's `ds_shape`), whose name contains neither "embed" nor "lm_head",
    are Muon's; embeddings, the output head, biases and norms AdamW's). A tag the user set already
    is kept (upstream overwrites it): that is how a model routes a parameter the name rule gets
    wrong. Then `muon_num_heads` per parameter ([Note: per-head tagging], opt-in with
    `optimizer.params.per_head_muon`). Reads upstream's `optimizer_name` / `optimizer_params`."""
    from .constants import MUON_OPTIMIZER
    from .zero.muon.per_head import layer_shape, tag_per_head

    name = getattr(config_class, "optimizer_name", None)
    if not isinstance(name, str) or name.lower() != MUON_OPTIMIZER:
        return
    for param_name, p in model.named_parameters():
        if not hasattr(p, "use_muon"):
            lowered = param_name.lower()
            p.use_muon = len(layer_shape(p)) >= 2 and "embed" not in lowered and "lm_head" not in lowered
    params = getattr(config_class, "optimizer_params", None) or {}
    tag_per_head(model, bool(params.get("per_head_muon", False)))


def _mesh_param_sequence(mesh_param: Any) -> int | None:
    """Upstream's `mesh_param=(data_parallel, sequence_parallel)`: its sequence degree (None without one)."""
    if mesh_param is None:
        return None
    if not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh_param):
        raise ValueError(f"deepspeed.initialize: mesh_param must be (data_parallel_size, sequence_parallel_size), "
                         f"two integers >= 1, got {mesh_param!r}")
    from .. import comm as ds_comm

    dp, sp = mesh_param
    if ds_comm.is_initialized() and dp * sp != ds_comm.get_world_size():
        raise ValueError(f"deepspeed.initialize: mesh_param={tuple(mesh_param)} covers {dp * sp} ranks but the world "
                         f"size is {ds_comm.get_world_size()}")
    return sp


def _data_parallel_size(raw: dict, mpu: Any, world_size: int, model: Any = None) -> int:
    """Replicas for batch arithmetic: the mpu's data-parallel size, else world / (sequence_parallel_size x
    tensor-parallel size) (upstream's rule: sequence- and tensor-parallel ranks share one micro-batch)."""
    from .engine_parallel import _alst_mpu, engine_tensor_parallel_size

    if mpu is not None:
        if _alst_mpu(mpu) and model is not None:
            # ALST's mpu may read an SP-only mesh that initialize refines with AutoTP's tensor dim ([Note: SP
            # x TP]): its data size would count the tensor ranks as replicas. Divisibility is the engine's check.
            return max(world_size // (int(mpu.get_sequence_parallel_world_size())
                                      * engine_tensor_parallel_size(model, raw)), 1)
        if hasattr(mpu, "get_data_parallel_world_size"):
            return int(mpu.get_data_parallel_world_size())
        if hasattr(mpu, "get_sequence_data_parallel_world_size"):   # upstream's parallel_state_sp
            return int(mpu.get_sequence_data_parallel_world_size()) // int(mpu.get_sequence_parallel_world_size())
    sp = raw.get("sequence_parallel_size", 1)
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else 1
    tp = engine_tensor_parallel_size(model, raw) if model is not None else 1
    if sp * tp > 1:
        if world_size % sp:
            from .config import DeepSpeedConfigError

            raise DeepSpeedConfigError(f"sequence_parallel_size={sp} must divide the world size ({world_size}): "
                                       f"choose a divisor of {world_size}")
        if world_size % (sp * tp):
            from .config import DeepSpeedConfigError

            raise DeepSpeedConfigError(f"tensor_parallel.autotp_size={tp} x sequence_parallel_size={sp} must divide "
                                       f"the world size ({world_size}): choose sizes whose product divides it")
        return world_size // (sp * tp)
    return world_size


def _tp_counted_batch(raw: dict, world_size: int, dp: int) -> dict:
    """transformers fills `train_batch_size` as micro x gas x world, counting tensor-parallel ranks as
    replicas (upstream's config does too when no mpu is passed); the samples per step are micro x gas x dp.
    That one value is taken as the TP-counted form and replaced by the true one (logged); other
    mismatches stay errors."""
    tp_section = raw.get("tensor_parallel")
    if dp == world_size or not isinstance(tp_section, dict):
        return raw
    batch, micro, gas = (raw.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps"))
    sp = raw.get("sequence_parallel_size", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (batch, micro, gas, sp)):
        return raw
    if batch != micro * gas * (world_size // sp) or batch == micro * gas * dp:
        return raw
    log_dist(f"train_batch_size={batch} counts the {world_size // sp // dp} tensor-parallel ranks of each replica "
             f"(transformers' rule); the engine trains micro x gas x data-parallel = {micro * gas * dp} samples per "
             "step", ranks=[0])
    return {**raw, "train_batch_size": micro * gas * dp}


def _is_pipeline_module(model: Any) -> bool:
    """Without importing the pipeline package for models that cannot be one."""
    import sys

    pipe = sys.modules.get("deepspeed.runtime.pipe.module")
    return pipe is not None and isinstance(model, pipe.PipelineModule)


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None,
                  tp_group: Any = None) -> torch.nn.Module:
    """AutoTP: shard `model`'s Linear layers over `tp_size` ranks in place and return it (cast to
    `dtype`). transformers' `deepspeed_init` and OpenRLHF call it before `deepspeed.initialize`; the
    sharding plan comes from `config["tensor_parallel"]` (layer specs, preset), else the model's
    Hugging Face tp_plan, else the automatic rule ([Note: the AutoTP plan] in module_inject/tp_plan.py).
    Collective: every rank calls it; TP rank 0's weights are the ones sliced. As upstream, it records
    tp_size, dtype and `tp_group` on the model for `initialize`, which fills a missing
    `tensor_parallel.autotp_size` from them and refuses conflicts (a different size or dtype, or an `mpu`
    next to `tp_group`). The groups come from the mesh: a `tp_group` must hold this rank's mesh TP ranks."""
    from .. import comm as ds_comm
    from .config import load_config_dict
    from ..module_inject.auto_tp import (broadcast_for_tensor_parallel, cast, shard_model, tensor_parallel_section,
                                         tp_size_from_config)
    from . import mesh

    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"deepspeed.tp_model_init: tp_size must be an integer >= 1, got {tp_size!r}")
    configured = tp_size_from_config(config)
    if configured > 1 and configured != tp_size:
        raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_size}) but the config's tensor_parallel.autotp_size is "
                         f"{configured}; make them agree")
    from ..module_inject.layers import set_autotp_mode

    set_autotp_mode(training=True)
    model = cast(model, dtype)
    model._ds_tp_model_init = {"tp_size": tp_size, "dtype": dtype, "tp_group": tp_group}
    if tp_size == 1:
        return model
    ds_comm.init_distributed(dist_init_required=None, verbose=False)
    sp = (load_config_dict(config).get("sequence_parallel_size", 1) if config is not None else 1) or 1
    parallel = mesh.initialize(sequence=int(sp), tensor=tp_size)
    group = parallel.group("tensor")
    if tp_group is not None:
        given = sorted(ds_comm.get_global_rank(tp_group, r) for r in range(ds_comm.get_world_size(tp_group)))
        if given != parallel.ranks("tensor"):
            raise ValueError(f"deepspeed.tp_model_init: tp_group holds ranks {given} but the tensor-parallel ranks "
                             f"of rank {ds_comm.get_rank()} are {parallel.ranks('tensor')} (tensor is the fastest "
                             "mesh dim: neighbouring ranks); pass that group or none")
    broadcast_for_tensor_parallel(model, group)
    shard_model(model, tp_size, tensor_parallel_section(config), group)
    return model


def default_inference_config() -> dict:
    return {}
