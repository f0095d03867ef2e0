"""The rank plan of AutoEP folded with AutoTP (DeepSpeed's `auto_ep_folding`): pure, no groups built.

Within a pipeline stage of S = world / pp ranks, dense layers use TP groups of `tp` consecutive ranks
and data-parallel groups strided by tp (dp = S / tp); experts use EP groups of `ep * etp`
consecutive ranks (which may span TP lanes) and expert-data-parallel groups strided by ep * etp
(edp = S / (ep * etp)). With tp = 1 this is the plan of the engine's `ep_size_<ep>` groups
(utils/groups.py). `validate_folding_global` states the rules DeepSpeed checks for the folded
configuration. This build's engine does not train AutoEP together with AutoTP
(runtime/engine_autoep.py refuses it): the plan and the rules are the library API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParallelFoldingSpec:
    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    tp_groups: tuple
    dense_dp_groups: tuple
    ep_groups: tuple
    edp_groups: tuple


@dataclass(frozen=True)
class FoldingGroupHandles:
    """The process groups a rank uses under folding, with their rank lists."""

    spec: ParallelFoldingSpec
    tp_group: Any
    dense_dp_group: Any
    ep_group: Any
    edp_group: Any
    ep_group_name: str
    tp_ranks: tuple
    dense_dp_ranks: tuple
    ep_ranks: tuple
    edp_ranks: tuple


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_folding_spec(*, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1,
                       mp_mode: str = "tp") -> ParallelFoldingSpec:
    """The sizes of the folded plan; ValueError naming the size that does not tile the stage."""
    for name, value in (("world_size", world_size), ("pp_size", pp_size), ("autotp_size", tp_size),
                        ("autoep_size", ep_size), ("expert_tensor_parallel_size", etp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide world_size={world_size}")
    stage = world_size // pp_size
    if stage % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} must divide the stage size {stage} (world_size / "
                         f"pp_size). Valid autotp_size values: {_divisors(stage)}")
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(f"autoep_size * expert_parallel.expert_tensor_parallel_size = {width} must divide the stage "
                         f"size {stage} (world_size / pp_size). Valid expert-width values: {_divisors(stage)}")
    return ParallelFoldingSpec(world_size, pp_size, stage, tp_size, stage // tp_size, ep_size, etp_size,
                               stage // width, mp_mode)


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """Every group of each kind, as rank tuples, over all pipeline stages."""
    tp, dp, ep, edp = [], [], [], []
    width = spec.ep_size * spec.etp_size
    for stage in range(spec.pp_size):
        ranks = range(stage * spec.stage_size, (stage + 1) * spec.stage_size)
        tp += [tuple(ranks[i:i + spec.tp_size]) for i in range(0, spec.stage_size, spec.tp_size)]
        dp += [tuple(ranks[lane::spec.tp_size]) for lane in range(spec.tp_size)]
        ep += [tuple(ranks[i:i + width]) for i in range(0, spec.stage_size, width)]
        edp += [tuple(ranks[lane::width]) for lane in range(width)]
    return FoldingGroupTables(tuple(tp), tuple(dp), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple]:
    """The rank tuples of each kind that hold `global_rank`."""
    tables = expected_folding_group_tables(spec)
    kinds = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups,
             "edp": tables.edp_groups}
    return {kind: next(g for g in groups if global_rank in g) for kind, groups in kinds.items()}


def assert_group_matches_spec(groups: tuple, spec: ParallelFoldingSpec) -> None:
    """`groups` = (ep rank lists, edp rank lists) as a registry holds them: RuntimeError unless they are the plan's."""
    ep_groups, edp_groups = (tuple(tuple(g) for g in kind) for kind in groups)
    tables = expected_folding_group_tables(spec)
    for kind, got, want in (("ep", ep_groups, tables.ep_groups), ("edp", edp_groups, tables.edp_groups)):
        if not set(got) <= set(want):
            raise RuntimeError(f"the {kind} group table {got} does not match folding spec {spec} (expected {want})")


def _mpu_size(mpu: Any, *names: str) -> Optional[int]:
    for name in names:
        if callable(getattr(mpu, name, None)):
            return int(getattr(mpu, name)())
    return None


def validate_folding_global(spec: ParallelFoldingSpec, *, zero_stage: int = 0, sp_size: int = 1,
                            deepcompile_enabled: bool = False, use_data_before_expert_parallel: bool = False,
                            mpu: Any = None, autoep_enabled: bool = True, tp_preset: Optional[str] = None,
                            ep_preset: Optional[str] = None, zero_offload_optimizer: bool = False,
                            zero_offload_param: bool = False) -> None:
    """DeepSpeed's rules for AutoEP (folded with AutoTP when tp > 1); ValueError naming the rule."""
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved: only "
                         "expert_tensor_parallel_size=1 is supported")
    if not autoep_enabled or spec.tp_size == 1:
        return
    folded = f"AutoEP+AutoTP folding (autotp_size={spec.tp_size}, autoep_size={spec.ep_size})"
    rules = [
        (spec.pp_size != 1, f"{folded} supports pp_size=1 only, got pp_size={spec.pp_size}"),
        (spec.ep_size == 1, f"{folded} needs autoep_size > 1; with autoep_size=1 disable expert_parallel"),
        (sp_size > 1, f"{folded}: tensor and sequence parallelism are mutually exclusive (sp_size={sp_size})"),
        (None not in (tp_preset, ep_preset) and tp_preset != ep_preset,
         f"{folded}: tensor_parallel.preset_model={tp_preset!r} and expert_parallel.preset_model={ep_preset!r} "
         "must match"),
        (zero_stage == 3, f"{folded} with ZeRO stage 3 is not supported; ZeRO-3 with AutoEP is a separate ZeRO-3 "
         "composition lane (autotp_size=1)"),
        (_mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size") not in
         (None, spec.tp_size), f"{folded}: the mpu tensor/model parallel world size "
         f"{_mpu_size(mpu, 'get_tensor_model_parallel_world_size', 'get_model_parallel_world_size')} differs from "
         f"autotp_size={spec.tp_size}"),
        (use_data_before_expert_parallel, f"{folded} does not support use_data_before_expert_parallel_"),
        (zero_offload_optimizer or zero_offload_param, f"{folded} does not support ZeRO offload (offload_optimizer/"
         "offload_param)"),
        (deepcompile_enabled, f"DeepCompile is not supported with {folded}"),
    ]
    for broken, message in rules:
        if broken:
            raise ValueError(message)
