"""AutoTP inside pipeline stages: each stage's layers sharded over the pipeline grid's slice group.

[Note: AutoTP in pipeline stages]
A PipelineModule over `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` already has tensor
peers: the grid's `slice` group (ranks with the same pipe and data coordinates). With
`tensor_parallel.autotp_size` equal to `num_mp`, the engine shards the layers this stage holds with
AutoTP's plan over that group, exactly as the 3-D path's own Megatron layers are sharded by hand:
the grid stays the one owner of every group (no second mesh), the data group and ZeRO's partition
come from the grid, the gradient norm counts sharded slices once and replicated parameters on slice
rank 0 only (the PipelineEngine's `SplitModel`), and replicated gradients are averaged over the
slice group at each step ([Note: TP-replicated gradients]). Activations cross stages between ranks of
the same slice coordinate, and every slice holds the whole activation (row layers all-reduce), so
the pipeline's sends are unchanged.
"""

from __future__ import annotations

from typing import Any


def is_pipeline_grid(mpu: Any) -> bool:
    """The grid of a PipelineModule (what `deepspeed.initialize` passes as the mpu of a pipeline)."""
    return mpu is not None and hasattr(mpu, "get_pipe_parallel_world_size") and hasattr(mpu, "get_slice_parallel_group")


def setup_pipeline_tensor_parallel(engine: Any, grid: Any, config_class: Any, sp: int, tp: int) -> bool:
    """Shard this stage's layers for `tp` slices of `grid` and set the engine's groups; True."""
    from ...module_inject.auto_tp import broadcast_for_tensor_parallel, shard_model
    from ...module_inject.layers import tensor_parallel_size
    from ...utils import groups
    from ..errors import NotSupportedYet
    from . import input_check
    from .replicated_grads import ReplicatedGradSync

    slices = int(grid.get_slice_parallel_world_size())
    if sp > 1:
        raise NotSupportedYet(f"sequence_parallel_size={sp} with a PipelineModule: sequence parallelism does not "
                              "combine with pipeline parallelism in this build (nor upstream's)")
    if slices != tp:
        raise ValueError(f"tensor_parallel.autotp_size={tp} with a PipelineModule whose topology has {slices} model "
                         f"(slice) rank(s) per stage: build it on PipeModelDataParallelTopology(num_pp, num_mp={tp}, "
                         "num_dp) so the pipeline grid holds the tensor-parallel groups")
    group = grid.get_slice_parallel_group()
    groups.mpu = grid
    if tensor_parallel_size(engine.module) == 1:
        broadcast_for_tensor_parallel(engine.module, group)
        shard_model(engine.module, tp, dict(config_class.raw.get("tensor_parallel") or {}), group)
    engine.mp_world_size = int(grid.get_model_parallel_world_size())
    engine._autotp_size = tp
    engine.sequence_parallel_size = 1
    engine.data_parallel_group = engine.seq_data_parallel_group = grid.get_data_parallel_group()
    engine.dp_world_size = engine.seq_dp_world_size = int(grid.get_data_parallel_world_size())
    names = {id(p): n for n, p in engine.module.named_parameters()}
    engine._tp_replicated = ReplicatedGradSync(group, tp, names)   # [Note: TP-replicated gradients]
    input_check.install(engine.module, group)   # slices of one stage must be fed the same micro-batch
    return True
