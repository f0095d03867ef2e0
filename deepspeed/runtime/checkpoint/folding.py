"""The folding record of EP x TP checkpoints ([Note: folding metadata] in checkpoint/autoep_universal.py):
what an engine with AutoEP folded into AutoTP writes into each file, and the check a loading engine
runs on what it reads (upstream's engine helpers `_make_autoep_folding_metadata` and
`_validate_autoep_folding_checkpoint_metadata`, here as functions of the CheckpointView)."""

from __future__ import annotations

from typing import Any

from ...checkpoint.constants import FOLDING_METADATA_KEY
from .view import CheckpointView


def folding_spec(view: CheckpointView) -> Any:
    """The ParallelFoldingSpec of an engine whose AutoEP layers are folded into AutoTP; None otherwise."""
    from ... import comm as ds_comm
    from ...module_inject.auto_ep_folding import build_folding_spec
    from ..engine_moe import moe_layers

    folds = [m.tensor_fold for _, m in moe_layers(view.module) if getattr(m, "tensor_fold", None) is not None]
    if not folds:
        return None
    layer = next(m for _, m in moe_layers(view.module) if getattr(m, "tensor_fold", None) is not None)
    return build_folding_spec(world_size=ds_comm.get_world_size(), pp_size=1, tp_size=int(folds[0][1]),
                              ep_size=int(layer.ep_size))


def param_family(name: str) -> str:
    """Upstream's parameter families of a folded model, by name."""
    if ".experts." in name:
        return "routed_expert"
    if ".router." in name:
        return "router_gate_replicated"
    return "shared_expert" if ".shared_experts" in name else "dense"


def make_engine_folding(view: CheckpointView, spec: Any, *, family: str, group: str, rank: int, count: int,
                        param_families: dict | None = None) -> dict:
    """This rank's `folding` record for one file (`group`/`rank`/`count`: the file's ZeRO partition)."""
    from ...checkpoint.autoep_universal import make_folding_metadata
    from ...utils import groups

    return make_folding_metadata(tp_size=spec.tp_size, tp_rank=view.split.tensor_rank, ep_size=spec.ep_size,
                                 ep_rank=groups._get_expert_parallel_rank(f"ep_size_{spec.ep_size}"),
                                 zero_partition_group=group, zero_partition_rank=rank, zero_partition_count=count,
                                 family=family, param_families=param_families)


def validate_checkpoint_folding(state: Any, *, folding_spec: Any, family: str, zero_partition_group: str,
                                zero_partition_count: int | None, tp_rank: int | None = None,
                                ep_rank: int | None = None, zero_partition_rank: int | None = None,
                                param_families: dict | None = None, require_when_folded: bool = True) -> None:
    """A loaded file's `folding` record against this run: a folded checkpoint needs a folded run of the
    same sizes, and a folded run needs the record (unless `require_when_folded` is false)."""
    from ...checkpoint.autoep_universal import (DISPATCH_STRATEGY, SHARED_EXPERT_PLACEMENT,
                                                validate_folding_metadata)

    recorded = isinstance(state, dict) and FOLDING_METADATA_KEY in state
    folded = folding_spec is not None and folding_spec.tp_size > 1
    if recorded and not folded:
        saved = state[FOLDING_METADATA_KEY]
        raise RuntimeError("Folded AutoEP+AutoTP checkpoint requires a folded runtime with matching "
                           f"tensor_parallel.autotp_size={saved.get('tp_size')} and expert_parallel.autoep_size="
                           f"{saved.get('ep_size')}; this run does not fold experts into tensor parallelism")
    if not folded or (not recorded and not require_when_folded):
        return
    validate_folding_metadata(state, tp_size=folding_spec.tp_size, ep_size=folding_spec.ep_size,
                              etp_size=folding_spec.etp_size, etp_rank=0, tp_rank=tp_rank, ep_rank=ep_rank,
                              zero_partition_group=zero_partition_group, zero_partition_rank=zero_partition_rank,
                              zero_partition_count=zero_partition_count, param_families=param_families, family=family,
                              shared_expert_placement=SHARED_EXPERT_PLACEMENT, dispatch_strategy=DISPATCH_STRATEGY)
