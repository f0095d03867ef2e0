"""The frozen public import surface: every path here must keep importing (libraries rely on them)."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest
from packaging.version import Version

SURFACE = [
    "deepspeed.initialize", "deepspeed.add_config_arguments", "deepspeed.init_distributed",
    "deepspeed.DeepSpeedEngine", "deepspeed.DeepSpeedConfig", "deepspeed.DeepSpeedConfigError",
    "deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.runtime.dataloader.DeepSpeedDataLoader", "deepspeed.runtime.dataloader.RepeatingLoader",
    "deepspeed.utils.RepeatingLoader", "deepspeed.utils.logger", "deepspeed.utils.log_dist",
    "deepspeed.utils.logging.logger",
    "deepspeed.runtime.base_optimizer.DeepSpeedOptimizer", "deepspeed.runtime.base_optimizer.ZeROOptimizer",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.comm.init_distributed", "deepspeed.comm.get_rank", "deepspeed.comm.get_world_size",
    "deepspeed.comm.get_local_rank", "deepspeed.comm.barrier", "deepspeed.comm.all_reduce",
    "deepspeed.comm.all_gather_into_tensor", "deepspeed.comm.reduce_scatter_tensor", "deepspeed.comm.broadcast",
    "deepspeed.comm.all_gather_object", "deepspeed.comm.is_initialized", "deepspeed.comm.new_group",
    "deepspeed.comm.ReduceOp", "deepspeed.comm.log_summary", "deepspeed.comm.comms_counter",
    "deepspeed.comm.reset_log", "deepspeed.comm.has_comm_data", "deepspeed.comm.get_comm_operation_count",
    "deepspeed.comm.get_logged_comm_ops", "deepspeed.comm.comm.comms_logger", "deepspeed.comm.configure",
    "deepspeed.utils.comms_logging.CommsLogger", "deepspeed.utils.comms_logging.calc_bw_log",
    "deepspeed.monitor.monitor.MonitorMaster", "deepspeed.monitor.monitor.Monitor",
    "deepspeed.monitor.tensorboard.TensorBoardMonitor", "deepspeed.monitor.csv_monitor.csvMonitor",
    "deepspeed.monitor.wandb.WandbMonitor", "deepspeed.monitor.comet.CometMonitor",
    "deepspeed.monitor.config.get_monitor_config", "deepspeed.monitor.config.DeepSpeedMonitorConfig",
    "deepspeed.monitor.utils.check_tb_availability",
    "deepspeed.profiling.flops_profiler.FlopsProfiler", "deepspeed.profiling.flops_profiler.get_model_profile",
    "deepspeed.profiling.flops_profiler.profiler.FlopsProfiler",
    "deepspeed.utils.timer.SynchronizedWallClockTimer", "deepspeed.utils.timer.ThroughputTimer",
    "deepspeed.utils.timer.NoopTimer", "deepspeed.utils.timer.FORWARD_GLOBAL_TIMER",
    "deepspeed.utils.SynchronizedWallClockTimer", "deepspeed.runtime.utils.see_memory_usage",
    "deepspeed.ops.adam.FusedAdam", "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.runtime.lr_schedules.WarmupLR", "deepspeed.runtime.lr_schedules.WarmupDecayLR",
    "deepspeed.runtime.lr_schedules.WarmupCosineLR", "deepspeed.runtime.lr_schedules.OneCycle",
    "deepspeed.runtime.lr_schedules.LRRangeTest",
    "deepspeed.config.Config", "deepspeed.config.TrainingConfig", "deepspeed.config.BatchConfig",
    "deepspeed.config.FP16Config",
    "deepspeed.launcher.runner.main", "deepspeed.env_report.cli_main",
    "deepspeed.utils.safe_get_full_fp32_param", "deepspeed.utils.safe_set_full_fp32_param",
    "deepspeed.utils.safe_get_full_grad", "deepspeed.utils.safe_set_full_grad",
    "deepspeed.utils.safe_get_full_optimizer_state", "deepspeed.utils.safe_set_full_optimizer_state",
    "deepspeed.utils.safe_get_local_fp32_param", "deepspeed.utils.safe_set_local_fp32_param",
    "deepspeed.utils.safe_get_local_grad", "deepspeed.utils.safe_set_local_grad",
    "deepspeed.utils.safe_get_local_optimizer_state", "deepspeed.utils.safe_set_local_optimizer_state",
    "deepspeed.utils.safe_update_full_grad_vectorized",
    "deepspeed.utils.tensor_fragment.safe_get_full_fp32_param",
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.config.DeepSpeedZeroConfig", "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadOptimizerConfig",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadParamConfig",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.torch_autocast.init_autocast_params",
    "deepspeed.runtime.torch_autocast.get_default_autocast_lower_precision_modules",
    "deepspeed.runtime.torch_autocast.has_autocast_dtype", "deepspeed.runtime.torch_autocast.is_autocast_initialized",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.utils.tensor_fragment.fragment_address", "deepspeed.checkpoint.ds_to_universal.main",
    "deepspeed.utils.set_z3_leaf_modules", "deepspeed.utils.unset_z3_leaf_modules",
    "deepspeed.utils.get_z3_leaf_modules", "deepspeed.utils.z3_leaf_module",
    "deepspeed.utils.set_z3_leaf_modules_by_name", "deepspeed.utils.set_z3_leaf_modules_by_suffix",
    "deepspeed.utils.z3_leaf_module.set_z3_leaf_modules",
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "deepspeed.checkpointing.configure", "deepspeed.checkpointing.is_configured", "deepspeed.checkpointing.checkpoint",
    "deepspeed.checkpointing.reset", "deepspeed.checkpointing.get_cuda_rng_tracker",
    "deepspeed.checkpointing.model_parallel_cuda_manual_seed", "deepspeed.checkpointing.CudaRNGStatesTracker",
    "deepspeed.checkpointing.CheckpointFunction", "deepspeed.checkpointing.non_reentrant_checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.non_reentrant_checkpoint",
    # RL and fine-tuning clients (docs/client_surface.md; behaviour in test_client_surface.py)
    "deepspeed.zero.GatheredParameters", "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum", "deepspeed.tp_model_init",
]


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


@pytest.mark.parametrize("path", SURFACE)
def test_public_name_imports(path: str) -> None:
    assert _resolve(path) is not None


def test_distribution_metadata_and_version() -> None:
    import deepspeed

    installed = importlib.metadata.version("deepspeed")  # HF checks the distribution, not the import
    assert installed == deepspeed.__version__
    v = Version(deepspeed.__version__)
    assert v >= Version("0.9.3") and v.local is not None and v.local.startswith("pure")
    assert (deepspeed.__version_major__, deepspeed.__version_minor__) == (v.major, v.minor)


def test_import_is_cheap() -> None:
    code = ("import sys, time, torch; before = set(sys.modules); t = time.perf_counter(); import deepspeed; "
            "dt = time.perf_counter() - t; new = set(sys.modules) - before; "
            "heavy = [m for m in ('pydantic', 'deepspeed.runtime.engine', 'tqdm') if m in new]; print(dt, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert float(out[0]) < 1.0
    assert out[1].strip() == "[]"
