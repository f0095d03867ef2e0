"""The engine's process groups, from the client's `mpu` or the config's parallel dims (runtime/mesh.py).

[Note: sequence-parallel gradient scale]
ZeRO (every stage) shards over, and gradients are averaged over, the sequence-data-parallel group
(data x sequence: every rank holding a replica of the parameters), dividing by its size sp x dp. Clients
hand `engine.backward` one of two kinds of loss under sequence parallelism:

* "whole": the replica's whole loss on every SP rank (ALST and Hugging Face's `deepspeed_sp_compute_loss`:
  per-shard losses joined by a differentiable all_gather, so each SP rank holds the same value and its
  backward sends each shard's gradient sp times): averaging over sp x dp gives the exact gradient;
* "share": each SP rank its share of the replica's loss, the shares adding up to it (the local-slice
  convention of Megatron-DeepSpeed with `DistributedAttention`): the SP ranks' gradients add up to the
  replica's, so the engine multiplies such a loss by sp before backward and the same average is exact again.

The convention comes from where the loss comes from, first of:
1. `engine.sequence_parallel_loss = "whole" | "share"`, set by the client (or by ALST's
   `UlyssesSPFwdLossBwdWithLogits`, which makes a whole loss);
2. "whole" when ALST's Ulysses attention (`UlyssesSPAttentionHF`, registered with transformers: the HF
   Trainer, Accelerate, ALST loops) ran in this engine's model: those clients join the shard losses;
3. unknown: then, and only then, a value test at every backward (one all_gather of the scalar over the SP
   group and a host sync): equal on every SP rank (to 1e-6 relative) is "whole", else "share". It cannot
   tell a share from a whole loss when the shares happen to coincide: declare the convention there.
A known "whole" is cross-checked by the same value test once, at the first backward: a loss that differs
across the SP ranks raises, naming both ways out. A known "share" cannot be checked (shares may coincide)
and costs nothing. So gradients, clipping and the logged grad norm are exact at every ZeRO stage (upstream
divides by dp at stages 0-2 and by sp x dp at stage 3, so one of the two conventions is off by sp at
each). A bare `loss.backward()` scales by sp for a known "share" and by 1 otherwise.
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


SEQUENCE_LOSS_CONVENTIONS = ("whole", "share")


def sequence_loss_factor(engine: Any, loss: torch.Tensor | None = None) -> int:
    """1 for a "whole" loss on every SP rank, sp for per-rank "share"s: [Note: sequence-parallel gradient
    scale]. `loss` None: a bare `loss.backward()` (no value to test). Collective over the SP group only
    while the convention is unknown, and once to cross-check a known "whole"."""
    sp = engine.sequence_parallel_size
    if sp <= 1:
        return 1
    convention = sequence_loss_convention(engine)
    if loss is None:
        return sp if convention == "share" else 1
    if convention is None:
        return 1 if _equal_on_sp_ranks(engine, loss)[0] else sp
    if convention == "whole" and not getattr(engine, "_sp_whole_checked", False):
        engine._sp_whole_checked = True
        equal, values = _equal_on_sp_ranks(engine, loss)
        if not equal:
            raise ValueError(
                f"sequence parallelism: the loss handed to backward differs across the {sp} sequence-parallel ranks "
                f"({values}), but this engine takes it as the replica's whole loss on every rank ({_why(engine)}). "
                "Join the per-rank losses as transformers' deepspeed_sp_compute_loss does (all_gather, weighted "
                "by valid tokens), or, if each rank's loss is its share of the replica's (the shares add up to "
                "it), set engine.sequence_parallel_loss = 'share'")
    return sp if convention == "share" else 1


def sequence_loss_convention(engine: Any) -> str | None:
    """"whole", "share" or None (unknown): declared, else "whole" where ALST's attention ran in the model."""
    declared = getattr(engine, "sequence_parallel_loss", None)
    if declared is not None:
        if declared not in SEQUENCE_LOSS_CONVENTIONS:
            raise ValueError(f"engine.sequence_parallel_loss={declared!r}: use 'whole' (the replica's loss on every "
                             "sequence-parallel rank), 'share' (each rank its share, adding up to it) or None")
        return declared
    if getattr(engine, "_sp_alst_seen", None) is None:   # looked up at the first backward, after a forward ran
        engine._sp_alst_seen = any(getattr(m, "_ds_ulysses_sp", False) for m in engine.module.modules())
    return "whole" if engine._sp_alst_seen else None


def _why(engine: Any) -> str:
    if getattr(engine, "sequence_parallel_loss", None) is not None:
        return "engine.sequence_parallel_loss = 'whole'"
    return "ALST's Ulysses attention (UlyssesSPAttentionHF) runs in the model, whose clients join the shard losses"


def _equal_on_sp_ranks(engine: Any, loss: torch.Tensor) -> tuple[bool, list[float]]:
    """Whether the loss is the same on every SP rank (to 1e-6 relative: a last-bit difference is still one
    loss) and the values; one all_gather of the scalar and a host sync."""
    value = loss.detach().reshape(1).to(torch.float64)
    gathered = [torch.empty_like(value) for _ in range(engine.sequence_parallel_size)]
    ds_comm.all_gather(gathered, value, group=engine.seq_parallel_group)
    values = [float(g) for g in gathered]
    first = values[0]
    same = [v == first or (v != v and first != first) or abs(v - first) <= 1e-6 * abs(first) for v in values]
    return all(same), values


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
                     "(e.g. for UlyssesSPDataLoaderAdapter) from the mpu after deepspeed.initialize", ranks=[0],
                     level=logging.WARNING)
    tensor_group = parallel.group("tensor")
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
