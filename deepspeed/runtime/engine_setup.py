"""Construction steps of the engine, as plain functions: device, broadcast, optimizer, scheduler, reducer."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .. import comm as ds_comm
from ..accelerator import get_accelerator
from ..utils.logging import log_dist, logger
from .agreement import agree_config
from .config.sections.base import TORCH_DTYPES
from .config.sections.precision import param_dtype_conflict
from .errors import NotSupportedYet, UsageError
from .grad_reducer import GradBucketReducer, ReducePolicy
from .precision.master_weights import check_built_optimizer, check_master_weights

# DDP's default bucket (25 MiB of fp32) when the user leaves reduce_bucket_size at its default:
# DeepSpeed's 5e8-element default would make one bucket and remove all overlap with backward.
_DEFAULT_DP_BUCKET_BYTES = 25 * 2**20
_FIRST_BUCKET_BYTES = 1 * 2**20


def check_supported(config: Any, what: str = "DeepSpeedEngine", optimizer: Any = None) -> None:
    """Agree the config across ranks (a no-op after deepspeed.initialize, which did), then fail
    early, on every rank, for config features the engine does not run yet and for low-precision
    master-weight settings upstream refuses (`optimizer`: the client's, checked when an instance)."""
    agree_config(config, what)   # before any collective: [Note: cross-rank config agreement]
    model = config.model
    unsupported: list[str] = []
    check_master_weights(config, optimizer)
    if not model.managed_gradient_accumulation and model.zero_optimization.stage < 2 \
            and model.zero_optimization.overlap_comm:
        # upstream's rule (its stage 0/1 reduction moves to step()); kept so a config valid here is valid there
        raise UsageError(f"managed_gradient_accumulation=false: overlap_comm only with ZeRO stage 2 or 3 (got stage "
                         f"{model.zero_optimization.stage}); set zero_optimization.overlap_comm=false")
    if unsupported:
        raise NotSupportedYet("Not implemented yet in this build of deepspeed: " + "; ".join(unsupported) +
                              ". See README.md, 'Features', for what is available.")


def resolve_device(local_rank: int) -> torch.device:
    accel = get_accelerator()
    if accel.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")  # host: the accelerator is the CPU


def broadcast_module_states(module: nn.Module, group: Any) -> None:
    """Make every replica start from rank 0's parameters and buffers, one broadcast per dtype."""
    if ds_comm.get_world_size(group) <= 1:
        return
    from .engine_moe import broadcast_expert_params
    from .zero.stage3.init_context import init_shard  # zero.Init parameters already agree (rank 0's)

    experts = broadcast_expert_params(module)   # over their expert-data-parallel groups
    tensors = [p.data for p in module.parameters() if init_shard(p) is None and id(p) not in experts] + \
        [b for b in module.buffers()]
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    src = ds_comm.get_global_rank(group, 0)
    for members in by_key.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        ds_comm.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _trainable(model_parameters: Any, module: nn.Module) -> Any:
    if model_parameters is None:
        return [p for p in module.parameters() if p.requires_grad]
    params = list(model_parameters)  # generators are consumed once: materialise
    return params


def build_optimizer_for_engine(engine: Any, client_optimizer: Any, model_parameters: Any) -> Any:
    """The client optimizer (instance or callable), else one built from the config, else None."""
    from .optimizers import build_optimizer

    config = engine._config.model
    params = _trainable(model_parameters, engine.module)
    if client_optimizer is not None:
        if config.optimizer is not None:
            logger.warning("deepspeed.initialize: both a client optimizer and an `optimizer` config section were "
                           "given; using the client optimizer and ignoring `optimizer` in the config")
        if isinstance(client_optimizer, torch.optim.Optimizer):
            optimizer = client_optimizer
        elif callable(client_optimizer):
            optimizer = client_optimizer(params)
        else:
            raise TypeError(f"deepspeed.initialize: optimizer must be a torch.optim.Optimizer or a callable taking "
                            f"the model parameters, got {type(client_optimizer).__name__}")
        _check_offload_client_optimizer(engine, optimizer)
        check_built_optimizer(engine._config, optimizer)   # an instance was checked by check_supported
    elif config.optimizer is not None:
        optimizer = build_optimizer(config.optimizer.type, _bf16_states_params(engine), params,
                                    on_cpu_offload=engine.zero_cpu_offload())   # DeepSpeedCPU* as upstream
    else:
        return None
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) > 0]
    log_dist(f"DeepSpeed Basic Optimizer = {type(optimizer).__name__}", ranks=[0])
    return optimizer


def _bf16_states_params(engine: Any) -> dict:
    """The optimizer section's params; with `bf16_optimizer_states` and ZeRO-Offload, the CPU Adam
    keeps its moments in bf16 (`fp32_optimizer_states` forced to False, as upstream's engine does)."""
    config = engine._config.model
    params = dict(config.optimizer.params)
    if config.bf16.bf16_optimizer_states and engine.zero_cpu_offload():
        if params.get("fp32_optimizer_states"):
            logger.warning("bf16_optimizer_states is enabled; overriding fp32_optimizer_states "
                           "to False so CPU Adam moments are stored in bf16.")
        if str(config.optimizer.type).lower() in ("adam", "adamw"):
            params["fp32_optimizer_states"] = False
    return params


def _check_offload_client_optimizer(engine: Any, optimizer: Any) -> None:
    """zero_force_ds_cpu_optimizer (default true), as upstream: ZeRO-Offload with a client optimizer
    must use one of DeepSpeed's CPU optimizers."""
    from ..ops.adagrad import DeepSpeedCPUAdagrad
    from ..ops.adam import DeepSpeedCPUAdam
    from ..ops.lion import DeepSpeedCPULion
    from .zero.utils import ZeRORuntimeException

    config = engine._config.model
    if (config.zero_optimization.stage > 0 and engine.zero_offload_optimizer() == "cpu"
            and config.zero_force_ds_cpu_optimizer
            and not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion))):
        raise ZeRORuntimeException(
            f"ZeRO-Offload (offload_optimizer.device=cpu) with a client optimizer ({type(optimizer).__name__}): use "
            "deepspeed.ops.adam.DeepSpeedCPUAdam (or DeepSpeedCPUAdagrad / DeepSpeedCPULion), or an `optimizer` "
            "section in the config; to use this optimizer anyway set \"zero_force_ds_cpu_optimizer\": false")


def build_lr_scheduler(engine: Any, client_scheduler: Any) -> Any:
    """The client scheduler (instance or callable taking the optimizer), else the config's, else None."""
    from .lr_schedules import build_scheduler

    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(engine.basic_optimizer)
        return client_scheduler
    section = engine._config.model.scheduler
    if section is None:
        return None
    if engine.basic_optimizer is None:
        # Upstream builds no scheduler without an optimizer. Trainer's inference-only initialize
        # (evaluate before train, ZeRO-3) keeps the training config's `scheduler` section.
        log_dist(f"scheduler.type={section.type!r} ignored: no optimizer (inference engine)", ranks=[0])
        return None
    return build_scheduler(section.type, dict(section.params), engine.basic_optimizer)


def build_reducer(engine: Any) -> GradBucketReducer | None:
    """Gradient buckets: averaged across ranks, and/or accumulated in another dtype.

    None for plain single-replica fp32 training (gradients stay ordinary `.grad` tensors) and
    for inference (no optimizer).
    """
    policy = engine.precision
    sharded = engine.stage.shard_optimizer_state
    if engine.stage.shard_parameters:
        return None  # ZeRO-3: the Stage3Coordinator reduce-scatters gradients per gather unit
    experts_shared = any(c.world > 1 for c in (getattr(engine, "_expert_comm", None) or {}).values())
    if engine.basic_optimizer is None or (engine.seq_dp_world_size <= 1 and not policy.is_mixed and not sharded
                                          and not experts_shared):   # tensor peers' expert shares: engine_moe.py
        return None
    config = engine._config
    params = [p for p in engine.module.parameters() if p.requires_grad]
    bucket_numel = _bucket_numel(engine, policy.grad_accum_dtype)
    first = None if config.is_set("zero_optimization.reduce_bucket_size") else \
        _FIRST_BUCKET_BYTES // (torch.finfo(policy.grad_accum_dtype).bits // 8)
    reduce = _reduce_policy(engine)
    reducer = GradBucketReducer(params, reduce, bucket_numel, policy.comm_dtype_fn(),
                                group=engine.seq_data_parallel_group, first_bucket_numel=first,
                                accum_dtype=policy.grad_accum_dtype, shard=sharded,
                                overlap=bool(config.model.zero_optimization.overlap_comm),
                                solo=frozenset(id(p) for p in engine._solo_bucket_params()),
                                comm_groups=getattr(engine, "_expert_comm", None))   # engine_moe.py
    reducer.names = {id(p): name for name, p in engine.module.named_parameters()}
    return reducer


def wrap_optimizer(engine: Any) -> Any:
    """Mixed precision wraps the base optimizer so it updates master weights; fp32 keeps it bare
    (as DeepSpeed returns the torch optimizer itself at stage 0 in fp32)."""
    from .precision.mixed_optimizer import MixedPrecisionOptimizer
    from .zero.optimizer import ZeroOptimizer
    from ..utils.tensor_fragment import register_optimizer  # safe_get_full_* find a parameter's state

    policy = engine.precision
    names = {id(p): name for name, p in engine.module.named_parameters()}
    if engine.basic_optimizer is not None and engine.stage.shard_optimizer_state:
        offload = engine._config.model.zero_optimization.offload_optimizer
        device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
        master_device = torch.device("cpu") if device in ("cpu", "nvme") else None  # host: offload_optimizer
        pin = master_device is not None and bool(offload.pin_memory)   # honoured on CUDA (zero/host_buffers.py)
        if engine.stage.shard_parameters:
            from .zero.stage3.optimizer import Stage3Optimizer

            wrapper = Stage3Optimizer(engine.basic_optimizer, engine._stage3, policy, engine.gradient_clipping(),
                                      names, group=engine.seq_data_parallel_group, master_device=master_device,
                                      pin_memory=pin)
        else:
            wrapper = ZeroOptimizer(engine.basic_optimizer, engine._reducer, policy, engine.gradient_clipping(),
                                    names, group=engine.seq_data_parallel_group, master_device=master_device,
                                    pin_memory=pin)
        wrapper._engine_ref = weakref.ref(engine)   # state_dict() is built like the checkpoint's
        if device == "nvme":
            from .swap_tensor import attach_optimizer_swapper

            attach_optimizer_swapper(wrapper, engine._config.model, engine.global_rank)
        wrapper.split = getattr(engine, "_split", None)   # tensor parallelism (engine_parallel.py)
        wrapper.tp_replicated = getattr(engine, "_tp_replicated", None)
        wrapper.optimizer_route = _optimizer_route(engine)
        return register_optimizer(wrapper)
    if engine.basic_optimizer is None or not policy.is_mixed:
        return register_optimizer(engine.basic_optimizer)
    wrapper = MixedPrecisionOptimizer(engine.basic_optimizer, engine._reducer, policy, engine.gradient_clipping(),
                                      names, group=engine.seq_data_parallel_group)
    wrapper._engine_ref = weakref.ref(engine)   # the optimizer's backward API (base_optimizer.py)
    wrapper.split = getattr(engine, "_split", None)
    wrapper.tp_replicated = getattr(engine, "_tp_replicated", None)
    wrapper.optimizer_route = _optimizer_route(engine)
    return register_optimizer(wrapper)


def _optimizer_route(engine: Any) -> str | None:
    """The wrapper class upstream's engine (0.19.8) would have built here (runtime/optimizer_routes.py):
    BF16_Optimizer at ZeRO stage 1 for bf16 with `data_types.grad_accum_dtype: "fp32"` given and no
    optimizer offload, and for bf16 pipelines without ZeRO; without ZeRO otherwise, for fp16 and bf16
    (whose gradients upstream accumulates in bf16 by default), FP16_Optimizer for a fused optimizer
    (FusedAdam) and FP16_UnfusedOptimizer for others; None where upstream uses its ZeRO classes or no
    wrapper (fp32). Ours accumulates bf16 gradients in fp32 whatever the route (docs/precision.md).
    bf16 without ZeRO with an explicit fp32 accumulation, which upstream refuses, is called BF16_Optimizer."""
    policy = engine.precision
    stage = engine._config.model.zero_optimization.stage
    explicit_fp32_accum = engine._config.model.data_types.grad_accum_dtype == "fp32"
    if policy.param_dtype == torch.bfloat16 and policy.master_dtype == torch.float32:
        if stage == 1 and explicit_fp32_accum and engine.zero_offload_optimizer() is None:
            return "BF16_Optimizer"
        if stage == 0 and (explicit_fp32_accum or type(engine).__name__ == "PipelineEngine"):
            return "BF16_Optimizer"
    if stage == 0 and policy.is_mixed and policy.param_dtype in (torch.float16, torch.bfloat16):
        from ..ops.adam import FusedAdam

        return "FP16_Optimizer" if isinstance(engine.basic_optimizer, FusedAdam) else "FP16_UnfusedOptimizer"
    return None


def cast_module(module: torch.nn.Module, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                keep_in_fp32: Any = "auto") -> None:
    """Floating parameters to `param_dtype` (None: left as they are); buffers keep their dtype (a
    rotary `inv_freq` stays fp32) unless `buffer_dtype` is given, and then buffers of modules named
    in `keep_in_fp32` ("auto": the model's own `_keep_in_fp32_modules`, as Hugging Face models
    declare) still stay."""
    for p in module.parameters() if param_dtype is not None else ():
        if p.is_floating_point() and p.dtype != param_dtype:
            p.data = p.data.to(param_dtype)
    if buffer_dtype is None:
        return
    keep = (getattr(module, "_keep_in_fp32_modules", None) or []) if keep_in_fp32 == "auto" else keep_in_fp32
    for name, sub in module.named_modules():
        if any(pattern in name.split(".") or pattern == name for pattern in keep):
            continue
        for key, buf in sub.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != buffer_dtype:
                sub._buffers[key] = buf.to(buffer_dtype)


# Upstream's engine exposes these three steps as methods (its unit tests call them on stand-ins
# holding `_config`, `fp16_enabled`, `bfloat16_enabled`, `module`); DeepSpeedEngine binds them.
def mixed_precision_dtypes(engine: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(parameter dtype, buffer dtype): the fp16/bf16 flag's dtype (None in fp32) and the
    `data_types.buffer_dtype` one (None: buffers keep their dtype)."""
    config = engine._config
    param_dtype = (torch.float16 if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled()
                   else None)
    if getattr(config, "param_dtype", None) is not None:
        param_dtype = TORCH_DTYPES[config.param_dtype]
    buffer_name = getattr(config, "buffer_dtype", None)
    return param_dtype, (TORCH_DTYPES[buffer_name] if buffer_name is not None else None)


def assert_valid_mixed_precision_config(engine: Any) -> None:
    """`data_types.param_dtype`, when given, must name the training precision itself."""
    conflict = param_dtype_conflict(engine._config.param_dtype, engine.fp16_enabled(), engine.bfloat16_enabled())
    if conflict:
        raise UsageError(f"data_types.param_dtype={conflict}")


def cast_module_mixed_precision(engine: Any, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                                zero_init: bool, keep_in_fp32: Any = "auto") -> None:
    """cast_module on the engine's module; under zero.Init the parameters' dtype is Init's own."""
    cast_module(engine.module, None if zero_init else param_dtype, buffer_dtype, keep_in_fp32)


def prepare_module(engine: Any) -> None:
    """Cast the module to the compute dtype and mark torch_autocast's lower-precision params.
    Below stage 3, parameters partitioned by zero.Init are made whole first."""
    policy = engine.precision
    if not engine.stage.shard_parameters:
        from .zero.stage3.init_context import materialize

        materialize(engine.module)
    data_types = engine._config.model.data_types
    engine._cast_module_mixed_precision(policy.param_dtype, TORCH_DTYPES.get(data_types.buffer_dtype or ""),
                                        False, data_types.keep_in_fp32_modules)
    if policy.autocast_dtype is not None:
        from .torch_autocast import init_autocast_params

        init_autocast_params(engine.module, policy.autocast_dtype,
                             list(policy.autocast_safe_modules) if policy.autocast_safe_modules else None)


def build_stage3_coordinator(engine: Any) -> Any:
    """ZeRO-3: partition the (cast, broadcast) module's parameters into gather units and install
    the gather/reduce hooks; None at stages 0-2."""
    if not engine.stage.shard_parameters:
        return None
    from ..utils.z3_leaf_module import apply_zero_leaf_module_config
    from .zero.stage3 import Stage3Coordinator

    zero = engine._config.model.zero_optimization
    apply_zero_leaf_module_config(engine.module, zero.leaf_module)  # flags join any set through the API
    if engine.precision.grad_accum_dtype != torch.float32:
        logger.warning(f"ZeRO-3 accumulates gradient shards in fp32: data_types.grad_accum_dtype="
                       f"{engine.precision.grad_accum_dtype} is ignored at stage 3 (docs/zero.md)")
    offload = zero.offload_param
    offloaded = offload is not None and offload.device in ("cpu", "nvme")
    coordinator = Stage3Coordinator(engine.module, persistence_threshold=zero.param_persistence_threshold,
                             model_persistence_threshold=zero.model_persistence_threshold,
                             group=engine.seq_data_parallel_group,
                             shard_device=torch.device("cpu") if offloaded else None,  # host: offload_param
                             pin_memory=offloaded and offload.pin_memory and torch.cuda.is_available(),
                             prefetch_bucket_size=zero.prefetch_bucket_size,
                             max_live_parameters=zero.max_live_parameters,
                             max_reuse_distance=zero.max_reuse_distance,
                             reduce_bucket_size=_bucket_numel(engine, engine.precision.param_dtype),
                             reduce_policy=_reduce_policy(engine),
                             comm_dtype=engine.precision.comm_dtype_override,
                             quantized_gradients=zero.zero_quantized_gradients,
                             quantized_weights=zero.zero_quantized_weights,
                             hpz_group=_hpz_group(engine, zero.zero_hpz_partition_size),
                             param_groups={pid: c.group for pid, c in (getattr(engine, "_expert_comm", None)
                                                                        or {}).items()   # engine_moe.py
                                           if c.world < engine.seq_dp_world_size})
    if offloaded and offload.device == "nvme":   # [Note: parameter swapping]
        from .swap_tensor.param_swapper import attach_param_swapper

        attach_param_swapper(coordinator, offload, engine._config.model.aio, engine.global_rank,
                             engine.seq_data_parallel_group)
    return coordinator


def _hpz_group(engine: Any, size: int) -> Any:
    """hpZ's node group of this rank from the parallel mesh ([Note: hpZ node groups]); None
    without hpZ (size 1, or a node as large as ZeRO's group: nothing to save)."""
    if size <= 1 or size == engine.seq_dp_world_size:
        return None
    from . import mesh

    parallel = mesh.current() if engine.seq_data_parallel_group is not None else mesh.initialize()
    if parallel is None or parallel.group("sequence_data") is not engine.seq_data_parallel_group and \
            engine.seq_data_parallel_group is not None:
        raise NotSupportedYet(f"zero_optimization.zero_hpz_partition_size={size} with ZeRO groups from a client "
                              "`mpu`: hpZ's node groups come from the parallel mesh; leave out the mpu or set it to 1")
    ranks, group = parallel.hpz_group(size)
    _warn_if_hpz_leaves_node(size, ranks)
    return group


def _warn_if_hpz_leaves_node(size: int, ranks: list[int]) -> None:
    """Upstream accepts a partition larger than a node (training stays correct, the saving is lost):
    so do we, with a warning from each affected node's first rank saying what it costs."""
    import os

    from .parallel_dims import hpz_node_crossing

    local_world = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")   # torchrun's / upstream's name
    problem = hpz_node_crossing(size, ranks, ds_comm.get_rank(), ds_comm.get_local_rank(),
                                int(local_world) if local_world else None)
    if problem is not None and ds_comm.get_local_rank() == 0:
        logger.warning(problem)


def _reduce_policy(engine: Any) -> ReducePolicy:
    model = engine._config.model
    return ReducePolicy(world_size=engine.seq_dp_world_size, prescale_gradients=model.prescale_gradients,
                        gradient_predivide_factor=model.gradient_predivide_factor,
                        op=model.gradient_allreduce_op)


def _bucket_numel(engine: Any, dtype: torch.dtype) -> int:
    """Elements per gradient bucket: the config's reduce_bucket_size, or DDP's 25 MiB of `dtype`
    when it is left at DeepSpeed's 5e8 default (which would make one bucket of everything)."""
    config = engine._config
    if config.is_set("zero_optimization.reduce_bucket_size"):
        return config.model.zero_optimization.reduce_bucket_size
    return _DEFAULT_DP_BUCKET_BYTES // (torch.finfo(dtype).bits // 8)


def check_zero_layout(engine: Any) -> None:
    """Errors for changes ZeRO's partition layout cannot follow, raised on every rank alike.

    The layout (which parameters are sharded, in which buckets) is fixed at initialize, so a
    parameter frozen or unfrozen afterwards would be silently mis-trained; and with
    `ignore_unused_parameters: false` a parameter without a gradient is an error. One small
    all-reduce (MAX) of per-rank flags makes every rank raise with the same names, so no rank
    is left waiting in the step's all-gather when only some ranks changed.
    """
    reducer = engine._reducer
    params = reducer.params()
    changed = any(not p.requires_grad for p in params) or \
        any(p.requires_grad and not reducer.owns(p) for p in engine.module.parameters())
    check_unused = not engine._config.model.zero_optimization.ignore_unused_parameters
    flags = [1.0 if changed else 0.0]
    if check_unused:
        flags += [0.0 if id(p) in reducer.seen else 1.0 for p in params]
    vector = torch.tensor(flags, device=engine.device)
    if engine.seq_dp_world_size > 1:
        ds_comm.all_reduce(vector, op=ds_comm.ReduceOp.MAX, group=engine.seq_data_parallel_group)
    names = {id(p): n for n, p in engine.module.named_parameters()} if bool((vector > 0).any()) else {}
    if vector[0] > 0:
        frozen = [names.get(id(p), "?") for p in params if not p.requires_grad]
        unfrozen = [n for n, p in engine.module.named_parameters() if p.requires_grad and not reducer.owns(p)]
        raise RuntimeError("requires_grad changed after deepspeed.initialize (on this or another rank), which "
                           f"ZeRO's partitioning cannot follow: frozen since: {frozen or 'none on this rank'}; "
                           f"unfrozen since: {unfrozen or 'none on this rank'}. Set requires_grad before "
                           "initialize (or build a new engine).")
    if check_unused and bool((vector[1:] > 0).any()):
        missing = [names.get(id(p), "?") for p, flag in zip(params, vector[1:].tolist()) if flag > 0]
        raise UsageError("zero_optimization.ignore_unused_parameters is false and these parameters received no "
                           f"gradient in this step on at least one rank: {missing}. Set ignore_unused_parameters: "
                           "true (the default) to treat them as zero gradients.")
