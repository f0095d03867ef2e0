"""`checkpoint_parallel_dimensions`: the pipeline and tensor degrees a model-states file was saved at
(upstream's record, read by `deepspeed.checkpoint.get_model_3d_descriptor` and `DeepSpeedCheckpoint`)."""

from __future__ import annotations

from ...checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE


def _pipeline_degree(mpu) -> int:
    for name in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
        if mpu is not None and hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def _tensor_degree(mpu) -> int:
    # ALST's mpu calls its sequence group "model parallel", but its ranks share one model-states file
    if mpu is None or hasattr(mpu, "initialize_sequence_parallel"):
        return 1
    for name in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                 "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def _checkpoint_parallel_metadata(mpu) -> dict:
    """{checkpoint_parallel_dimensions: {pp_degree, tp_degree}} of a client's model-parallel unit
    (Megatron's or DeepSpeed's pipeline grid names; 1 and 1 without one)."""
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: _pipeline_degree(mpu),
                                       CHECKPOINT_TP_DEGREE: _tensor_degree(mpu)}}


def recorded_parallel_dims(mpu, grid, mp_world_size: int) -> dict:
    """The record our writer adds to each model-states file. Without a client mpu or pipeline grid the
    tensor degree is AutoTP's (the engine's mp_world_size). Left out (readers then count files, as for
    older checkpoints) where the degrees would not match the mp_rank file count."""
    unit = mpu if mpu is not None else grid
    record = _checkpoint_parallel_metadata(unit)
    dims = record[CHECKPOINT_PARALLEL_DIMS]
    if unit is None or hasattr(unit, "initialize_sequence_parallel"):
        dims[CHECKPOINT_TP_DEGREE] = max(1, int(mp_world_size))
    return record if dims[CHECKPOINT_PP_DEGREE] * dims[CHECKPOINT_TP_DEGREE] == mp_world_size else {}
