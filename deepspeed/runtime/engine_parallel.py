"""The engine's process groups, from the client's `mpu` or the config's parallel dims (runtime/mesh.py).

The loss convention under sequence parallelism lives in sequence_loss.py ([Note: sequence-parallel
gradient scale]).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm as ds_comm
from ..utils import groups


def _sp_only(mpu: Any) -> bool:
    return hasattr(mpu, "initialize_sequence_parallel")


def setup_parallel_groups(engine: Any, mpu: Any, config_class: Any) -> None:
    """Set the engine's group attributes (upstream's names):

    data_parallel_group / dp_world_size          replicas that see different data (batch arithmetic)
    seq_data_parallel_group / seq_dp_world_size  ZeRO's partition group and the gradient average (dp x sp)
    sequence_parallel_size / seq_parallel_group  ranks that share one sample's sequence
    mp_world_size                                model-parallel size (1 under ALST's sp-only mpu)

    A group of None is the whole world. With tensor parallelism ([Note: AutoTP in the engine])
    the groups come from the mesh with its tensor dim."""
    sp_config = int(config_class.model.sequence_parallel_size)
    engine.seq_parallel_group = None
    engine._split = None
    engine._tp_replicated = None   # [Note: TP-replicated gradients] (runtime/tensor_parallel/replicated_grads.py)
    engine.sequence_parallel_loss = None   # "whole" / "share": [Note: sequence-parallel gradient scale]
    if _setup_tensor_parallel(engine, mpu, config_class, sp_config):
        return
    if mpu is not None:
        groups.mpu = mpu
        if hasattr(mpu, "get_sequence_parallel_world_size"):
            sp = int(mpu.get_sequence_parallel_world_size())
            if sp_config > 1 and sp_config != sp:
                raise ValueError(f"sequence_parallel_size={sp_config} in the config but the mpu's sequence-parallel "
                                 f"world size is {sp}; make them agree (or leave the key out)")
            engine.sequence_parallel_size = sp
            engine.seq_parallel_group = mpu.get_sequence_parallel_group()
            engine.seq_data_parallel_group = mpu.get_sequence_data_parallel_group()
            engine.seq_dp_world_size = int(mpu.get_sequence_data_parallel_world_size())
        else:
            engine.sequence_parallel_size = 1
            if sp_config > 1 and hasattr(mpu, "get_pipe_parallel_world_size"):
                from .errors import NotSupportedYet

                raise NotSupportedYet(f"sequence_parallel_size={sp_config} with a PipelineModule: sequence parallelism "
                                      "does not combine with pipeline parallelism in this build (nor upstream's)")
            if sp_config > 1:
                raise ValueError(f"sequence_parallel_size={sp_config} with an mpu that has no sequence-parallel "
                                 "groups (get_sequence_parallel_group); pass an mpu with them or leave the key out")
        if hasattr(mpu, "get_data_parallel_group"):
            engine.data_parallel_group = mpu.get_data_parallel_group()
            engine.dp_world_size = int(mpu.get_data_parallel_world_size())
        else:   # upstream's parallel_state_sp has no data-parallel accessors: dp = (dp x sp) / sp
            engine.data_parallel_group = None
            engine.dp_world_size = engine.seq_dp_world_size // engine.sequence_parallel_size
        if engine.sequence_parallel_size == 1:
            engine.seq_data_parallel_group = engine.data_parallel_group
            engine.seq_dp_world_size = engine.dp_world_size
        engine.mp_world_size = 1 if _sp_only(mpu) or not hasattr(mpu, "get_model_parallel_world_size") \
            else int(mpu.get_model_parallel_world_size())
        engine._split = _client_tensor_split(mpu)
        engine._split_from_mpu = engine._split is not None   # not AutoTP's (engine_moe.py tells them apart)
        return
    engine.mp_world_size = 1
    engine.sequence_parallel_size = sp_config
    if sp_config > 1:
        from . import mesh

        parallel = mesh.initialize(sequence=sp_config)
        engine.data_parallel_group = parallel.group("data")
        engine.dp_world_size = parallel.size("data")
        engine.seq_data_parallel_group = parallel.group("sequence_data")
        engine.seq_dp_world_size = parallel.size("sequence_data")
        engine.seq_parallel_group = parallel.group("sequence")
        return
    engine.data_parallel_group = engine.seq_data_parallel_group = None
    engine.dp_world_size = engine.seq_dp_world_size = engine.world_size


def engine_tensor_parallel_size(module: Any, raw: dict) -> int:
    """The TP size: the config's `tensor_parallel.autotp_size`, else the size the module was already
    sharded for (`tp_model_init`); the two must agree."""
    from ..module_inject.auto_tp import tp_size_from_config
    from ..module_inject.layers import tensor_parallel_size

    configured, sharded = tp_size_from_config(raw), tensor_parallel_size(module)
    args = tp_model_init_args(module)
    by_init = max(sharded, args.get("tp_size", 1)) if args or sharded > 1 else None
    if configured > 1 and by_init is not None and configured != by_init:
        raise ValueError(f"tensor_parallel.autotp_size={configured} but the model was sharded by tp_model_init for "
                         f"tp_size={by_init}; make them agree")
    return max(configured, by_init or 1)


def _client_tensor_split(mpu: Any) -> Any:
    """[Note: a client mpu's tensor layers] A Megatron-style `mpu` (tensor x data, no pipeline: what
    Megatron-DeepSpeed passes without pipeline parallelism) means the model holds tensor slices of its
    own: the gradient norm and the overflow check must combine over the tensor group, counting a
    tagged slice (`tensor_model_parallel`) on every tensor rank and a replicated parameter on tensor
    rank 0 only, as the pipeline's 3-D path does; else each tensor rank clips by its own partial norm
    and tensor peers drift apart. None without tensor slices (a pipeline grid sets its own)."""
    from .tensor_parallel.pipeline import is_pipeline_grid

    if mpu is None or _sp_only(mpu) or is_pipeline_grid(mpu):
        return None
    size = getattr(mpu, "get_tensor_model_parallel_world_size", None) or getattr(mpu, "get_model_parallel_world_size",
                                                                                 None)
    if size is None or int(size()) <= 1:
        return None
    from .optimizer_wrapper import SplitModel

    if hasattr(mpu, "get_tensor_model_parallel_group"):
        return SplitModel(mpu.get_tensor_model_parallel_group(), tensor_rank=int(mpu.get_tensor_model_parallel_rank()))
    return SplitModel(mpu.get_model_parallel_group(), tensor_rank=int(mpu.get_model_parallel_rank()))


def tp_model_init_args(module: Any) -> dict:
    """What `deepspeed.tp_model_init` recorded on this model (tp_size, dtype, tp_group); {} if not called."""
    return getattr(module, "_ds_tp_model_init", None) or {}


def _check_tp_model_init_args(module: Any, raw: dict, mpu: Any) -> None:
    """Upstream's merge rules for `tp_model_init`'s arguments at `initialize`: its tp_group and a client
    `mpu` are two sources of the TP group (refused together); its dtype must be the config's."""
    import torch

    args = tp_model_init_args(module)
    if not args:
        return
    if args.get("tp_group") is not None and mpu is not None:
        raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu as well "
                         "(two sources of the tensor-parallel group): pass one of them")
    enabled = lambda key: isinstance(raw.get(key), dict) and bool(raw[key].get("enabled"))  # noqa: E731
    config_dtype = torch.bfloat16 if enabled("bf16") else torch.float16 if enabled("fp16") else None
    if config_dtype is not None and args.get("dtype") is not None and config_dtype != args["dtype"]:
        raise ValueError(f"Conflicting dtype: the config enables {config_dtype} but tp_model_init was given "
                         f"dtype={args['dtype']}; make them agree")


def _setup_tensor_parallel(engine: Any, mpu: Any, config_class: Any, sp: int) -> bool:
    """[Note: AutoTP in the engine]
    Tensor-parallel ranks hold slices of one replica and see the same batch: the mesh's `data` group
    (batch arithmetic, the data loader) and `sequence_data` group (ZeRO's partition, the gradient
    average, the initial broadcast) leave the tensor dim out. The model is sharded here when the
    config asks for it and `tp_model_init` has not done so. Gradient-norm clipping and the overflow
    check combine over the tensor group too, counting each sharded parameter's slices once and each
    replicated parameter on TP rank 0 only (`SplitModel.tensor_rank`). The replicated parameters'
    gradients are averaged over the tensor group at each step ([Note: TP-replicated gradients]), so TP
    peers never drift apart. False without TP."""
    _check_tp_model_init_args(engine.module, config_class.raw, mpu)
    tp = engine_tensor_parallel_size(engine.module, config_class.raw)
    if tp <= 1:
        return False
    from .mesh import current as mesh_current, initialize as mesh_initialize
    from .optimizer_wrapper import SplitModel
    from .tensor_parallel import input_check
    from .tensor_parallel.replicated_grads import ReplicatedGradSync
    from ..module_inject.auto_tp import broadcast_for_tensor_parallel, shard_model
    from ..module_inject.layers import tensor_parallel_size

    from .tensor_parallel.pipeline import is_pipeline_grid, setup_pipeline_tensor_parallel

    if is_pipeline_grid(mpu):   # [Note: AutoTP in pipeline stages]
        return setup_pipeline_tensor_parallel(engine, mpu, config_class, sp, tp)
    sp = _sequence_degree_for_tp(mpu, sp, tp)
    previous = mesh_current()
    parallel = mesh_initialize(sequence=sp, tensor=tp)
    if sp > 1:   # ALST's registered attentions: the refined mesh's sequence group, their TP slice of the heads
        import logging

        from .sequence_parallel.ulysses_sp import follow_mesh
        from ..utils.logging import log_dist

        follow_mesh(parallel)
        if previous is not None and previous.ranks("sequence") != parallel.ranks("sequence"):
            log_dist(f"sequence parallelism x AutoTP: the sequence groups now span {parallel.ranks('sequence')} "
                     f"(tensor is the fastest mesh axis; were {previous.ranks('sequence')}): take sequence groups "
                     "from the mpu after deepspeed.initialize (a UlyssesSPDataLoaderAdapter made before follows "
                     "the new ones itself)", ranks=[0],
                     level=logging.WARNING)
    tensor_group = parallel.group("tensor")
    engine.sequence_parallel_size = sp
    from .engine_autoep import setup_autoep

    # AutoEP swaps the experts before AutoTP shards the rest ([Note: EP x TP folding] in moe/tp_tokens.py)
    setup_autoep(engine, tensor_fold=(tensor_group, tp, parallel.rank("tensor")))
    if tensor_parallel_size(engine.module) == 1:   # not yet sharded by tp_model_init: the config asks for it
        broadcast_for_tensor_parallel(engine.module, tensor_group)
        shard_model(engine.module, tp, dict(config_class.raw.get("tensor_parallel") or {}), tensor_group)
    engine.mp_world_size = engine._autotp_size = tp
    engine.sequence_parallel_size = sp
    engine.data_parallel_group = parallel.group("data")
    engine.dp_world_size = parallel.size("data")
    engine.seq_data_parallel_group = parallel.group("sequence_data")
    engine.seq_dp_world_size = parallel.size("sequence_data")
    engine.seq_parallel_group = parallel.group("sequence") if sp > 1 else None
    engine._split = SplitModel(tensor_group, tensor_rank=parallel.rank("tensor"))
    names = {id(p): n for n, p in engine.module.named_parameters()}
    engine._tp_replicated = ReplicatedGradSync(tensor_group, tp, names)   # [Note: TP-replicated gradients]
    input_check.install(engine.module, tensor_group)   # TP peers must be fed the same batch
    return True


def _alst_mpu(mpu: Any) -> bool:
    """ALST's `mpu` (runtime/sequence_parallel/parallel_state_sp): a facade over the mesh itself."""
    return getattr(mpu, "__name__", None) == "deepspeed.runtime.sequence_parallel.parallel_state_sp"


def _sequence_degree_for_tp(mpu: Any, sp: int, tp: int) -> int:
    """The sequence degree of the SP x TP mesh ([Note: SP x TP] in sequence_parallel/ulysses_sp.py): the
    config's, or that of ALST's mpu, which reads the mesh and so follows its refinement with the tensor dim.
    Any other client mpu is refused: the mesh makes the tensor-parallel groups."""
    if mpu is None:
        return sp
    if not _alst_mpu(mpu):
        raise ValueError(f"tensor_parallel.autotp_size={tp} with a client `mpu`: the mesh makes the tensor-parallel "
                         "groups; pass no mpu (or leave autotp_size out and shard with your mpu's layers). ALST's "
                         "mpu (UlyssesSPAttentionHF.register_with_transformers) composes with it")
    from .mesh import current

    parallel = current()
    have = parallel.size("sequence") if parallel is not None else 1
    if sp > 1 and have != sp:
        raise ValueError(f"sequence_parallel_size={sp} in the config but ALST's mpu has sequence-parallel world size "
                         f"{have}; make them agree (or leave the key out)")
    return have
