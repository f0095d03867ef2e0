"""Expert parallelism in the engine: expert groups, where expert gradients are reduced, the norm.

[Note: expert gradients]
An expert parameter (`allreduce=False`, `group_name="ep_size_<ep>"`; deepspeed.moe.utils) lives on
one expert-parallel (EP) rank and is replicated over its expert-data-parallel (EDP) group of
W/ep ranks. Its local gradient already sums the contributions of the tokens of all ep ranks of
its EP group (the all-to-all's backward brings them home), so the gradient of the global loss
(the mean of the W ranks' losses) is the SUM over the EDP group divided by W, not by the EDP size:
the reducer reduces each expert bucket over its EDP group and divides by the policy's world size
W, as for dense buckets. Upstream divides by the EDP size, which makes the expert update ep times
larger at ep>1 than at ep=1 (#6545); here ep=1, 2, 4 give the same update on the same global batch.

ZeRO-1/2 shard each expert bucket over its EDP group (each element owned by one rank of it, and
distinct EP ranks hold distinct experts), so the sum of the squared local shards over all W ranks
counts every parameter once: the usual global-norm all-reduce is exact. ZeRO-3 partitions each
expert unit over its EDP group in the same way ([Note: ZeRO-3 expert units] in
zero/stage3/coordinator.py), so the same holds there. Without ZeRO every rank
holds whole gradients: the norm sums the dense parameters on EP rank 0 only and each rank's
experts, over the EP group (a SplitModel, as tensor parallelism does for its replicated parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import comm as ds_comm
from ..moe.utils import is_moe_param
from ..utils import groups
from .engine_autoep import setup_autoep
from .agreement import agreed
from .errors import NotSupportedYet


def is_moe_layer(module: nn.Module) -> bool:
    """deepspeed.moe.layer.MoE, or a module with its engine-facing surface (expert_group_name,
    num_local_experts, set_deepspeed_parallelism), as hand-built expert-parallel layers have."""
    from ..moe.layer import MoE

    return isinstance(module, MoE) or all(hasattr(module, a) for a in
                                          ("expert_group_name", "num_local_experts", "set_deepspeed_parallelism"))


def moe_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of each MoE layer in registration order: upstream's `moe_layer_id` order."""
    return [(name, m) for name, m in module.named_modules() if is_moe_layer(m)]


def ep_size_of(group_name: str) -> int:
    try:
        return int(str(group_name).rsplit("_", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"expert parameter group_name={group_name!r}: expected upstream's 'ep_size_<n>'") from None


def setup_moe(engine: Any) -> None:
    """Build the expert groups of the module's MoE layers (upstream's engine calls
    `set_deepspeed_parallelism()` on each at init), check the configuration, and record where each
    expert parameter's gradient is reduced (`engine._expert_comm`, read by the gradient reducer).
    Every rank raises alike: the checks depend on the model and the config only."""
    setup_autoep(engine)   # AutoEP: swap HF MoE experts for expert-parallel ones first (engine_autoep.py)
    layers = moe_layers(engine.module)
    engine.has_moe_layers = bool(layers)
    engine.moe_layers = [m for _, m in layers]
    engine.num_experts = [getattr(m, "num_experts", None) for m in engine.moe_layers]
    engine._expert_comm = {}
    experts = [p for p in engine.module.parameters() if is_moe_param(p)]
    if not layers and not experts:
        return
    names = sorted({str(getattr(p, "group_name", "")) for p in experts} |
                   {str(m.expert_group_name) for m in engine.moe_layers})
    sizes = {name: ep_size_of(name) for name in names}
    stage = int(engine._config.model.zero_optimization.stage)
    if stage == 3 and max(sizes.values()) > 1:
        _check_zero3(engine, max(sizes.values()), experts)
    folded = [m for m in engine.moe_layers if getattr(m, "tensor_fold", None) is not None]
    if folded and len(folded) != len(engine.moe_layers):
        raise NotSupportedYet("MoE layers of your own next to AutoEP's under tensor_parallel.autotp_size: only "
                              "AutoEP's layers split their tokens over the tensor peers ([Note: EP x TP folding])")
    mpu_tp = _client_mpu_tensor_size(engine, sizes, stage) if not folded else 0
    if not folded and mpu_tp == 0 and (_autotp_split(engine) or engine.sequence_parallel_size > 1 or
                                        engine.mpu is not None):
        raise NotSupportedYet(f"MoE layers (ep_size {sorted(sizes.values())}) with sequence or pipeline parallelism, "
                              "AutoTP, or an mpu of those: expert parallelism combines with data parallelism, "
                              "ZeRO 0-3, AutoEP with tensor_parallel.autotp_size and MoE with a Megatron-style "
                              "tensor-parallel mpu only in this build")
    use_data_before = bool(engine.config.get("use_data_before_expert_parallelism", False))
    for layer in engine.moe_layers:
        try:
            layer.set_deepspeed_parallelism(use_data_before)
        except TypeError:   # a hand-built layer without upstream's argument
            layer.set_deepspeed_parallelism()
    for name in names:   # parameters marked without a layer that built their groups
        if name not in groups._expert_names():
            groups._create_expert_and_data_parallel(sizes[name], use_data_before_expert_parallel_=use_data_before)
    from .grad_reducer import CommGroup

    shared = {str(m.expert_group_name) for m in engine.moe_layers if getattr(m, "tensor_fold", None) is not None}
    comm = {}
    for name in names:   # experts seeing a share of the tokens: summed over all their holders ([Note: EP x TP folding])
        ranks, group = groups._get_expert_holders_group(name) if name in shared else (
            groups._get_expert_data_parallel_group_ranks(name), groups._get_expert_data_parallel_group(name))
        comm[name] = CommGroup(name, group, len(ranks), ranks.index(ds_comm.get_rank()))
    engine._expert_comm = {id(p): comm[str(p.group_name)] for p in experts}
    if folded or mpu_tp > 1:
        if engine._split is None:   # a client mpu's tensor group: dense parameters counted as under AutoTP
            from .optimizer_wrapper import SplitModel

            engine._split = SplitModel(groups._get_model_parallel_group(), tensor_rank=groups._get_model_parallel_rank())
        _split_for_tensor_experts(engine, stage, [comm[name].rank for name in names], set(names) - shared)
        return
    parallel = {s for s in sizes.values() if s > 1}
    if stage == 0 and parallel:   # whole gradients on every rank: [Note: expert gradients]
        if len(parallel) > 1 and engine._config.model.gradient_clipping > 0:
            raise NotSupportedYet(f"gradient_clipping with MoE layers of several ep_size {sorted(parallel)} at "
                                  "zero_optimization.stage 0: use one ep_size, or ZeRO stage 1 or 2")
        from .optimizer_wrapper import SplitModel

        name = f"ep_size_{max(parallel)}"
        engine._split = SplitModel(groups._get_expert_parallel_group(name),
                                   expert_rank=groups._get_expert_parallel_rank(name))


def _autotp_split(engine: Any) -> bool:
    """The engine's tensor split is AutoTP's (not a client mpu's tensor layers)."""
    return engine._split is not None and not getattr(engine, "_split_from_mpu", False)


def _client_mpu_tensor_size(engine: Any, sizes: dict, stage: int) -> int:
    """The tensor-parallel size of a Megatron-style client mpu that `deepspeed.moe.layer.MoE` layers
    compose with (upstream's E + M + D; the mesh takes its tensor dim, so the expert groups lie inside
    the tensor lanes); 0 when there is no such mpu (none, ALST's, a pipeline grid, or AutoTP)."""
    from ..moe.layer import MoE

    mpu = engine.mpu
    if mpu is None or _autotp_split(engine) or engine.sequence_parallel_size > 1 or \
            hasattr(mpu, "initialize_sequence_parallel") or hasattr(mpu, "get_pipe_parallel_world_size") or \
            not hasattr(mpu, "get_model_parallel_world_size"):
        return 0
    pipe = getattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 1)()
    tp = int(mpu.get_model_parallel_world_size())
    if int(pipe) > 1 or not all(isinstance(m, MoE) for m in engine.moe_layers):
        return 0
    if stage == 3 and max(sizes.values()) > 1 and tp > 1:
        raise NotSupportedYet(f"deepspeed.moe.layer.MoE (ep_size {sorted(sizes.values())}) with a tensor-parallel mpu "
                              f"(model parallel size {tp}) at zero_optimization.stage 3: expert units partitioned over "
                              "their holders are not built with a client mpu; use ZeRO 0-2")
    if tp > 1:
        from . import mesh

        built = mesh.initialize(tensor=tp)   # the mpu's layout: tensor peers are consecutive ranks (Megatron's)
        agreed("deepspeed.initialize with a tensor-parallel client mpu and MoE layers",
               lambda: _check_consecutive_tensor_peers(mpu, built), ValueError)
    return tp


def _check_consecutive_tensor_peers(mpu: Any, built: Any) -> None:
    """The expert groups lie inside the mesh's tensor lanes, which are runs of consecutive ranks
    (Megatron's order); an mpu whose model-parallel groups are laid out otherwise would put experts
    on ranks that do not share their tokens: refuse it (agreed: some ranks may still match)."""
    from .. import comm as ds_comm

    theirs = sorted(ds_comm.get_all_ranks_from_group(mpu.get_model_parallel_group()))
    ours = sorted(built.ranks("tensor"))
    if theirs != ours:
        raise ValueError(f"the client mpu's model-parallel group of rank {ds_comm.get_rank()} is ranks {theirs}; "
                         f"deepspeed.moe.layer.MoE under a tensor-parallel mpu needs Megatron's layout, tensor peers on "
                         f"consecutive ranks ({ours} here)")


def _split_for_tensor_experts(engine: Any, stage: int, holder_ranks: list[int], whole: set) -> None:
    """The norm under EP x TP ([Note: EP x TP folding]): at ZeRO 1/2 each expert element lives on one
    of its holders, so every rank counts its expert shards (the dense ones as AutoTP counts them);
    without ZeRO every holder has the whole expert, so the norm sums over the world and only the first
    holder counts an expert, only data rank 0 a dense parameter. `whole`: the expert groups whose experts
    see every token (MoE's `enable_expert_tensor_parallelism`): counted over the tensor group as dense
    parameters are (tensor rank 0, or every tensor rank for a parameter tagged `tensor_model_parallel`)."""
    from dataclasses import replace

    if whole and len(whole) != len(holder_ranks):
        raise NotSupportedYet("MoE layers with and without enable_expert_tensor_parallelism under one mpu: use one "
                              "setting for every MoE layer")
    split = replace(engine._split, experts_see_all_tokens=bool(whole))
    if stage >= 1:
        engine._split = replace(split, expert_counted=True)
        return
    if len(set(holder_ranks)) > 1:
        raise NotSupportedYet("expert layers of several ep_size under tensor parallelism at zero_optimization.stage "
                              "0: use one ep_size, or ZeRO stage 1 or 2")
    data_rank = ds_comm.get_rank(engine.seq_data_parallel_group) if engine.seq_dp_world_size > 1 else 0
    engine._split = replace(split, model_group=None, data_rank=data_rank, expert_counted=holder_ranks[0] == 0)


def _check_zero3(engine: Any, ep: int, experts: list[nn.Parameter]) -> None:
    """What ZeRO-3 with expert units ([Note: ZeRO-3 expert units]) does not combine with yet."""
    from .zero.stage3.init_context import init_shard

    zero = engine._config.model.zero_optimization
    quantized = [k for k in ("zero_quantized_gradients", "zero_quantized_weights") if getattr(zero, k)]
    quantized += ["zero_hpz_partition_size"] if zero.zero_hpz_partition_size > 1 else []
    if quantized:
        raise NotSupportedYet(f"expert parallelism (ep_size={ep}) with ZeRO-3 and {' / '.join(quantized)} (ZeRO++): "
                              "not supported in this build; leave them off")
    if any(init_shard(p) is not None for p in experts):
        raise NotSupportedYet(f"expert parallelism (ep_size={ep}) with ZeRO-3 and expert parameters created under "
                              "deepspeed.zero.Init: not supported in this build; build the model outside zero.Init")


def broadcast_expert_params(module: nn.Module) -> set[int]:
    """Make every expert-data-parallel replica start from its first member's experts (one broadcast
    per EDP group and dtype); returns the ids of the expert parameters, which the dense broadcast
    over the data-parallel group must leave alone (they differ across EP ranks)."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    done: set[int] = set()
    for p in module.parameters():
        name = getattr(p, "group_name", None)
        if not is_moe_param(p) or name is None or name not in groups._expert_names():
            continue
        by_key.setdefault((str(name), p.dtype, p.device), []).append(p.data)
        done.add(id(p))
    for (name, _, _), members in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if groups._get_expert_data_parallel_world_size(name) <= 1:
            continue
        flat = torch.cat([t.reshape(-1) for t in members])
        ds_comm.broadcast(flat, src=groups._get_expert_broadcast_src_rank(name),
                          group=groups._get_expert_data_parallel_group(name))
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return done
