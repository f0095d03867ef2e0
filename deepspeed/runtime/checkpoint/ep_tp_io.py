"""EP x TP in the MoE checkpoint layout ([Note: MoE checkpoint layout] in moe_io.py).

[Note: EP x TP checkpoint layout]
Experts with tensor parallelism (AutoEP folded into AutoTP, or `deepspeed.moe.layer.MoE` with a
Megatron-style mpu) write upstream's files with the tensor rank as `mp_rank_XX`: the first data rank
of each tensor rank writes `mp_rank_{tp}_model_states.pt` (its slices of the tensor-parallel layers,
the replicated ones, the engine state), the first expert-data-parallel rank of each expert writes
`layer_{L}_expert_{E}_mp_rank_{tp}_model_states.pt` (folded: one file per expert, from the tensor rank
that holds it; with an mpu each tensor rank holds a copy and writes its own), and the optimizer goes to
`[bf16_]zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt` (ZeRO) or `expp_rank_{ep}_mp_rank_{tp}_...`
(stage 0). AutoEP's files carry upstream's folding record ([Note: folding metadata]). Every
model-states file records the layout (`ep_tp_layout`: tensor and expert-parallel sizes): a load reads
its own tensor rank's files and resumes exactly at the layout that saved. At another tensor or expert
size the expert files lie on other tensor ranks' files and the optimizer pieces of the sliced layers are
cut by tp, so the tag is read joined as `ds_to_universal` joins it (checkpoint/moe_join.py, one parameter's
field at a time; `other_layout` decides) and each rank cuts its slices from the whole tensors as from a
universal checkpoint; experts sliced over the tensor ranks are refused there, naming both layouts.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from ...checkpoint.constants import EP_TP_LAYOUT_KEY, FOLDING_METADATA_KEY
from ...checkpoint.files import CheckpointError, expert_file, load_file, model_file
from ...utils import groups
from .folding import folding_spec, make_engine_folding, param_family, validate_checkpoint_folding
from .view import CheckpointView

LAYOUT_KEY = EP_TP_LAYOUT_KEY


def tensor_size(view: CheckpointView) -> int:
    """The tensor-parallel size experts are combined with (1 without: the plain MoE layout)."""
    split = view.split
    if split is None or getattr(split, "expert_counted", None) is None:   # [Note: EP x TP folding]
        return 1
    return int(groups._get_model_parallel_world_size())


def layout(view: CheckpointView) -> dict:
    sizes = sorted({int(m.ep_size) if hasattr(m, "ep_size") else int(str(m.expert_group_name).rsplit("_", 1)[1])
                    for m in view.moe_layers})
    # experts sliced over the tensor ranks themselves (MoE's enable_expert_tensor_parallelism): zero_to_fp32 refuses
    sliced = bool(getattr(view.split, "experts_see_all_tokens", False))
    return {"tensor_parallel_size": tensor_size(view), "expert_parallel_sizes": sizes, "expert_tensor_parallel": sliced}


def describe(saved: dict) -> str:
    return f"tensor-parallel size {saved.get('tensor_parallel_size', 1)} x ep_size {saved.get('expert_parallel_sizes')}"


def other_layout(view: CheckpointView, path: str, mp: int) -> bool:
    """Whether the MoE-layout tag `path` was saved at another EP x TP layout than this run's (one of them with
    tensor parallelism): then load_checkpoint reads it joined whole (moe_io.moe_reader)."""
    own = os.path.join(path, model_file(mp))
    saved, mine = _layouts(view, load_file(own if os.path.isfile(own) else os.path.join(path, model_file(0))))
    if saved["tensor_parallel_size"] == mine["tensor_parallel_size"] == 1:
        return False
    return saved != mine and not saved.get("expert_tensor_parallel") and not mine["expert_tensor_parallel"]


def _layouts(view: CheckpointView, model_states: dict) -> tuple[dict, dict]:
    """(the layout that saved, this run's)."""
    return model_states.get(LAYOUT_KEY) or {"tensor_parallel_size": 1, "expert_parallel_sizes": None}, layout(view)


def check_layout(view: CheckpointView, path: str, model_states: dict) -> None:
    """Refuse a checkpoint of another EP x TP layout that `other_layout` cannot join (experts sliced over the
    tensor ranks; [Note: EP x TP checkpoint layout]); runs inside the load's agreed phase, so every rank
    raises alike."""
    saved, mine = _layouts(view, model_states)
    if saved["tensor_parallel_size"] == mine["tensor_parallel_size"] == 1:
        return   # the plain MoE layout: any ep_size (moe_io)
    if saved != mine:
        raise CheckpointError(f"{path} was saved with experts at {describe(saved)}; this run has {describe(mine)}: "
                              "experts sliced over the tensor ranks (MoE enable_expert_tensor_parallelism) resume only "
                              "at the tensor and expert-parallel sizes that saved them (the data-parallel size and "
                              f"ZeRO stage may differ); resume at {describe(saved)}")
    spec = folding_spec(view)
    if spec is not None:   # AutoEP folded: upstream's record, checked as upstream checks it
        validate_checkpoint_folding(model_states, folding_spec=spec, family="dense", zero_partition_group="dense_dp",
                                    zero_partition_count=None, tp_rank=view.split.tensor_rank)
    elif FOLDING_METADATA_KEY in model_states:
        validate_checkpoint_folding(model_states, folding_spec=None, family="dense", zero_partition_group="dense_dp",
                                    zero_partition_count=None)


def expert_source(path: str, layer: int, expert: int, mp: int) -> str:
    """This tensor rank's file of an expert, else the one file another tensor rank wrote (folded AutoEP)."""
    own = os.path.join(path, expert_file(layer, expert, mp))
    if os.path.isfile(own):
        return own
    found = glob.glob(os.path.join(path, f"layer_{layer}_expert_{expert}_mp_rank_*_model_states.pt"))
    return found[0] if len(found) == 1 else own


def optimizer_files(found: list[str], mp: int, tp: int) -> list[str]:
    """The optimizer files this tensor rank reads: its own tensor rank's (all of them without TP)."""
    return found if tp == 1 else [f for f in found if f"_mp_rank_{mp:02d}_" in os.path.basename(f)]


def model_record(view: CheckpointView, state: dict, dp: int, dp_size: int) -> None:
    """Add the layout (and, folded, upstream's folding record) to this tensor rank's model states."""
    state[LAYOUT_KEY] = layout(view)
    spec = folding_spec(view)
    if spec is not None:
        families = {k: param_family(k) for k in state["module"]}
        state[FOLDING_METADATA_KEY] = make_engine_folding(view, spec, family="dense", group="dense_dp", rank=dp,
                                                          count=dp_size, param_families=families)


def expert_record(view: CheckpointView, layer: Any) -> dict:
    """Folded AutoEP: the folding record of this rank's expert files and stage-0 optimizer file; else {}."""
    spec = folding_spec(view)
    if spec is None:
        return {}
    name = str(layer.expert_group_name)
    return {FOLDING_METADATA_KEY: make_engine_folding(
        view, spec, family="routed_expert", group="edp", rank=groups._get_expert_data_parallel_rank(name),
        count=groups._get_expert_data_parallel_world_size(name))}


def optimizer_record(view: CheckpointView, dp: int, dp_size: int) -> dict:
    """Folded AutoEP at ZeRO 1/2: upstream's `zero_optimizer_state` record with each parameter's family and
    the partition its optimizer state is cut over (experts: their holders; the rest: the data ranks)."""
    spec = folding_spec(view)
    if spec is None:
        return {}
    comm = view.expert_comm
    families = {}
    for name, p in view.module.named_parameters():
        if not p.requires_grad:
            continue
        expert = comm.get(id(p))
        families[name] = {"family": param_family(name), "zero_partition_group": "edp" if expert else "dense_dp",
                          "zero_partition_rank": expert.rank if expert else dp,
                          "zero_partition_count": expert.world if expert else dp_size}
    return {FOLDING_METADATA_KEY: make_engine_folding(view, spec, family="zero_optimizer_state", group="per_family",
                                                      rank=dp, count=dp_size, param_families=families)}
