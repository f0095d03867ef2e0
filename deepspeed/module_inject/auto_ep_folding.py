"""The rank plan of AutoEP folded with AutoTP (DeepSpeed's `auto_ep_folding`): pure, no groups built.

Within a pipeline stage of S = world / pp ranks, dense layers use TP groups of `tp` consecutive ranks
and data-parallel groups strided by tp (dp = S / tp); experts use EP groups of `ep * etp`
consecutive ranks (which may span TP lanes) and expert-data-parallel groups strided by ep * etp
(edp = S / (ep * etp)). With tp = 1 this is the plan of the engine's `ep_size_<ep>` groups
(utils/groups.py). `validate_folding_global` states the rules DeepSpeed checks for the folded
configuration; the engine applies them (runtime/engine_autoep.py) and trains the folded layout
([Note: folded assignment dispatch] in moe/ep_tp_dispatch.py).

Gradient families: `autoep_folding_gradient_reduction_strategy` is how the optimizer step's
tensor-group reduction ([Note: TP-replicated gradients] in runtime/tensor_parallel/replicated_grads.py)
treats a gradient under folding: "average" for what the tensor peers hold whole (dense, norms, the
router: equal gradients here, since the folded dispatch gives exact ones), "sum" for a parameter
marked as a per-peer partial, "skip" for tensor-parallel slices and routed experts (reduced over
their holders, runtime/engine_moe.py). Upstream also returns "expert_tp_cancel" for experts, to
divide out the tp factor its restore leaves in their gradients; this dispatch leaves none, so
experts are "skip" here and that value is never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"   # upstream's; never returned here (docstring)
AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
_ROUTER, _PARTIAL_ROUTER, _SP_NORM = "router_gate_replicated", "router_gate_partial", "sp_sharded_layernorm"


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


def mark_autoep_folding_router_parameter(param: Any) -> None:
    """A router/gate parameter: run on every tensor peer's (identical) tokens, so "average"."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, _ROUTER)


def mark_autoep_folding_partial_router_parameter(param: Any) -> None:
    """A router parameter whose gradient is a partial on each tensor peer (a router that sees only
    its peer's tokens): "sum" in the token-split modes ("tp", "sp")."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, _PARTIAL_ROUTER)


def mark_autoep_folding_sp_sharded_layernorm_parameter(param: Any) -> None:
    """A norm over a sequence shard: a partial ("sum") only when the fold is sequence-parallel."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, _SP_NORM)


def autoep_folding_gradient_reduction_strategy(folding_spec: Any, param: Any, *,
                                               param_name: Optional[str] = None) -> str:
    """"skip", "average" or "sum": what the step's tensor-group reduction does with `param`'s
    gradient under `folding_spec` (its `tp_size`, `mp_mode`; see the module docstring). `param_name`
    is accepted for upstream's signature; the family comes from the parameter's marks."""
    from .layers import is_tensor_parallel

    if folding_spec is None or int(getattr(folding_spec, "tp_size", 1)) <= 1:
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if is_tensor_parallel(param) or getattr(param, "model_parallel", False):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if getattr(param, "allreduce", True) is False:   # a routed expert: reduced over its holders
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    family, mode = getattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, None), getattr(folding_spec, "mp_mode", "tp")
    if family == _PARTIAL_ROUTER and mode in ("tp", "sp") or family == _SP_NORM and mode == "sp":
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    return AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE
