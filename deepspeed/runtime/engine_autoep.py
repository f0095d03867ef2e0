"""The engine's AutoEP hook: with `expert_parallel.enabled`, swap the model's MoE experts for
expert-parallel ones before the engine's MoE set-up (engine_moe.py) finds them, so the expert
groups, the expert-gradient reduction and the broadcasts treat them as any expert layer. Under
AutoTP the swap runs first, before AutoTP shards the dense layers (engine_parallel.py), with the
expert groups folded over the tensor dim ([Note: EP x TP folding] in moe/tp_tokens.py)."""

from __future__ import annotations

from typing import Any, Optional


def setup_autoep(engine: Any, tensor_fold: Optional[tuple] = None) -> None:
    """No-op unless the config's `expert_parallel` section is enabled (or the swap already ran).
    `tensor_fold` = (tensor group, size, rank) under AutoTP. Every rank raises alike on a bad plan
    or layout (it depends on the model and the config only), before any collective."""
    section = dict(engine.config.get("expert_parallel") or {})
    if not section.get("enabled", False) or getattr(engine, "autoep_plan", None) is not None:
        return
    from .errors import NotSupportedYet
    from ..module_inject.auto_ep import apply_autoep

    ep = int(section.get("autoep_size", 1))
    if tensor_fold is not None:
        _check_folding(engine, section, ep, int(tensor_fold[1]))
    elif engine._split is not None or engine.sequence_parallel_size > 1 or engine.mpu is not None:
        raise NotSupportedYet(f"expert_parallel.autoep_size={ep} with sequence parallelism (sequence_parallel_size="
                              f"{engine.sequence_parallel_size}), pipeline parallelism or a client mpu: the expert "
                              "groups fold over data (and AutoTP's tensor) ranks only in this build; AutoEP combines "
                              "with data parallelism, ZeRO 0-3 and tensor_parallel.autotp_size")
    _materialize_zero_init_moe_blocks(engine.module, section)
    engine.autoep_plan = apply_autoep(engine.module, section, ep,
                                      broadcast_group=None if tensor_fold else engine.seq_data_parallel_group,
                                      use_data_before_expert_parallel=bool(
                                          engine.config.get("use_data_before_expert_parallelism", False)),
                                      tensor_fold=tensor_fold)


def _materialize_zero_init_moe_blocks(model: Any, section: dict) -> None:
    """A model built under zero.Init holds its MoE blocks as partitioned placeholders; AutoEP cuts each
    rank's experts from the whole fused tensors (and a whole-block swap copies the router), so those
    blocks are made whole and plain first (one block at a time; collective, in module order, the same on
    every rank). The rest of the model stays partitioned; ZeRO-3 then partitions the swapped experts over
    their expert-data-parallel group like any expert (the blocks' memory is what a model built without
    zero.Init needs at this point)."""
    import re

    from ..module_inject.auto_ep_plan import resolve_preset
    from .zero.stage3 import init_context

    if not any(init_context.init_shard(p) is not None for p in model.parameters()):
        return
    _, preset = resolve_preset(model, section)
    pattern = re.compile(preset.moe_layer_pattern)
    for name, module in model.named_modules():
        if pattern.fullmatch(name) and any(init_context.init_shard(p) is not None for p in module.parameters()):
            init_context.materialize(module)


def _check_folding(engine: Any, section: dict, ep: int, tp: int) -> None:
    """What AutoEP with AutoTP does not combine with: upstream's folding rules, and ZeRO-3 with a reason."""
    from .errors import NotSupportedYet
    from .. import comm as ds_comm
    from ..module_inject.auto_ep_folding import build_folding_spec, validate_folding_global

    stage = int(engine._config.model.zero_optimization.stage)
    if engine.sequence_parallel_size > 1:
        raise NotSupportedYet(f"expert_parallel.autoep_size={ep} with sequence_parallel_size="
                              f"{engine.sequence_parallel_size} (and tensor_parallel.autotp_size={tp}): expert groups "
                              "do not fold over the sequence dim in this build (nor upstream's)")
    if stage == 3:
        raise NotSupportedYet(f"expert_parallel.autoep_size={ep} with tensor_parallel.autotp_size={tp} at "
                              "zero_optimization.stage 3: ZeRO-3 partitions expert units over their expert-data-"
                              "parallel groups and AutoTP's slices over the data group, and the folded layout "
                              "(expert groups spanning tensor peers) has no unit plan yet (upstream refuses it too); "
                              "use ZeRO 0-2, or autotp_size=1 for AutoEP at ZeRO-3")
    if engine.mpu is not None:
        raise NotSupportedYet(f"expert_parallel.autoep_size={ep} with tensor_parallel.autotp_size={tp} and a client "
                              "mpu: the mesh makes both the tensor and the folded expert groups; pass no mpu")
    if bool(engine.config.get("use_data_before_expert_parallelism", False)):
        raise ValueError(f"use_data_before_expert_parallelism with expert_parallel.autoep_size={ep} and "
                         f"tensor_parallel.autotp_size={tp}: the folded layout has one rank order (expert groups "
                         "of consecutive ranks); leave the key out")
    spec = build_folding_spec(world_size=ds_comm.get_world_size(), pp_size=1, tp_size=tp, ep_size=ep,
                              etp_size=int(section.get("expert_tensor_parallel_size", 1)))
    tp_preset = (engine.config.get("tensor_parallel") or {}).get("preset_model")
    validate_folding_global(spec, zero_stage=stage, sp_size=engine.sequence_parallel_size,
                            tp_preset=tp_preset, ep_preset=section.get("preset_model"))
