"""What the engine hands to the checkpoint code: one CheckpointView per save or load call.

[Note: checkpoint view]
No module under runtime/checkpoint (nor runtime/pipe/checkpoint.py) takes or reads the engine. Each
checkpoint entry point of the engine (engine.py, engine_accessors.py) builds a CheckpointView
(`EngineAccessors._checkpoint_view`) and passes that on: the objects a save reads and a load writes
(module, optimizer, scheduler, the ZeRO-3 coordinator), the layout (ranks, groups, the expert and
tensor-parallel splits, the pipeline grid), the settings (stage, precision, the checkpoint section)
and the step counters as they are at the call. A load writes the counters back through the view's
`set_counters` (inside the agreed apply phase, with the rest of the state, so a failed load changes
none of them); a background save is parked in the engine's PendingSlot, the one owner of it. The view
is the whole interface: the engine may rename its private attributes without touching the checkpoint
code, and a reader sees in this file everything that code depends on (tests/unit/test_checkpoint_view.py
keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # (types only: the checkpoint modules import nothing of the engine's)
    import torch

    from ...checkpoint.reader import CheckpointReader
    from ..grad_reducer import CommGroup
    from ..optimizer_wrapper import SplitModel
    from ..pipe.topology import PipelineParallelGrid
    from ..zero.stage3 import Stage3Coordinator
    from .save_job import PendingSave


@dataclass(frozen=True)
class Counters:
    """The engine's step counters, as saved in (and restored from) the model-states file."""
    global_steps: int
    global_samples: int
    skipped_steps: int


class PendingSlot:
    """The engine's background save still running ([Note: background save] in save_job.py), or None.
    Engine-owned; the checkpoint code fills and empties it only through the view."""

    def __init__(self) -> None:
        self.current: PendingSave | None = None

    def put(self, pending: PendingSave) -> None:
        self.current = pending

    def take(self) -> PendingSave | None:
        pending, self.current = self.current, None
        return pending


@dataclass(frozen=True, eq=False)
class CheckpointView:
    """Everything save_checkpoint / load_checkpoint / save_16bit_model read of the engine ([Note:
    checkpoint view]): built by the engine at each call, so the checkpoint code never sees the engine."""
    # the objects whose state is saved and loaded
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None   # the engine's wrapper (ZeroOptimizer, Stage3Optimizer, ...)
    has_optimizer: bool          # False at ZeRO-3 inference, where `optimizer` is the parameter-offload view
    lr_scheduler: object | None  # anything with state_dict / load_state_dict
    stage3: Stage3Coordinator | None
    # layout: ranks and groups of the files this rank writes and reads
    global_rank: int
    dp_group: object | None      # the (sequence x) data-parallel group the optimizer state is sharded over
    dp_rank: int
    dp_world_size: int
    mp_rank: int                 # the `mp_rank_XX` of this rank's files (file_mp_rank)
    mp_world_size: int
    mpu: object | None           # a client's model-parallel unit
    split: SplitModel | None     # tensor / expert split of the model (AutoTP, EP x TP)
    expert_comm: dict[int, CommGroup]   # id(expert parameter) -> its expert-data-parallel group; empty: no experts
    moe_layers: list[torch.nn.Module]
    num_experts: list[int | None]
    grid: PipelineParallelGrid | None
    pipeline: bool               # a PipelineEngine: modules are saved per layer
    num_stages: int
    stage_id: int
    # settings
    zero_stage: int
    bf16: bool
    mixed_precision: bool        # stage 0 with fp16/bf16: optimizer state in per-rank files too
    gradient_clipping: float
    train_batch_size: int
    gather_16bit_weights: bool   # zero_optimization.stage3_gather_16bit_weights_on_model_save
    ds_config: dict              # the config as given, saved into the files
    tag_validation: str          # checkpoint.tag_validation: IGNORE / WARN / FAIL
    async_save: bool             # checkpoint.async_save
    load_universal: bool         # checkpoint.load_universal
    # counters (read at the call) and what the checkpoint code may change in the engine
    counters: Counters
    set_counters: Callable[[Counters], None]
    pending: PendingSlot
    # the pipeline engine's own files and reader (None for other engines)
    extra_files: Callable[[bool], list[tuple[str, dict]]] | None
    reader_factory: Callable[[CheckpointView, str, str], CheckpointReader] | None


def file_mp_rank(mpu: object | None, split: SplitModel | None) -> int:
    """The `mp_rank_XX` of this rank's files: its position among the ranks holding the other parts
    of its model replica (a pipeline stage's index), 0 without model parallelism (upstream's rule)."""
    # ALST's mpu names its sequence group "model parallel", but those ranks share weights
    if mpu is None or hasattr(mpu, "initialize_sequence_parallel"):
        # AutoTP (also with ALST): the tensor rank writes its slices, as upstream's mp_rank_XX files
        return split.tensor_rank if split is not None else 0
    if not hasattr(mpu, "get_model_parallel_rank"):
        return 0
    return int(mpu.get_model_parallel_rank())
