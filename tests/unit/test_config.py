"""DeepSpeedConfig: sources, 0.19.8 defaults, accepted real-world values, the engine-facing API."""

import base64
import json
import logging

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, RootConfig, load_config_dict
from deepspeed.runtime.config.sections.zero import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                                    DeepSpeedZeroOffloadParamConfig, OffloadOptimizerConfig,
                                                    OffloadParamConfig, ZeroConfig)
from deepspeed.utils.logging import logger

BASE = {"train_batch_size": 8}
MAXSIZE = 9223372036854775807

# Defaults read from DeepSpeed 0.19.8's source (runtime/constants.py, precision_config.py,
# zero/config.py, zero/offload_config.py, monitor/config.py, comm/constants.py, ...), written
# out here by hand so that a drifting model default fails this table.
DEFAULTS = {
    "managed_gradient_accumulation": True,
    "steps_per_print": None,
    "gradient_clipping": 1.0,
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    # expert_parallel: upstream's AutoEPConfig defaults (deepspeed/module_inject/auto_ep_presets/base.py)
    "expert_parallel.enabled": False,
    "expert_parallel.autoep_size": 1,
    "expert_parallel.preset_model": None,
    "expert_parallel.moe_layer_pattern": None,
    "expert_parallel.expert_pattern": None,
    "expert_parallel.router_pattern": None,
    "expert_parallel.expert_w1": None,
    "expert_parallel.expert_w2": None,
    "expert_parallel.expert_w3": None,
    "expert_parallel.num_experts_attr": None,
    "expert_parallel.top_k_attr": None,
    "expert_parallel.has_shared_experts": None,
    "expert_parallel.shared_experts_pattern": None,
    "expert_parallel.shared_experts_gate_pattern": None,
    "expert_parallel.expert_tensor_parallel_size": 1,
    "expert_parallel.validate_folding_routing": False,
    "expert_parallel.use_grouped_mm": True,
    "expert_parallel.disable_triton_grouped_mm": False,
    "expert_parallel.combine_impl": "auto",
    "expert_parallel.route_norm": None,
    "expert_parallel.route_scale": 1.0,
    "expert_parallel.score_apply": "auto",
    "expert_parallel.score_func": "auto",
    "expert_parallel.top_k": "auto",
    "expert_parallel.num_expert_groups": None,
    "expert_parallel.num_limited_groups": None,
    "expert_parallel.routed_scaling_factor": "auto",
    "expert_parallel.load_balance_coeff": None,
    "tensor_parallel.autotp_size": 0,
    "tensor_parallel.tp_overlap_comm": False,
    "tensor_parallel.preset_model": None,
    "tensor_parallel.partition_config": None,
    "tensor_parallel.dtype": None,
    "tensor_parallel.keep_module_on_host": False,
    "tensor_parallel.injection_policy_tuple": None,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",
    "disable_allgather": False,
    "dump_state": False,
    "disable_python_gc": False,
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "dataloader_drop_last": False,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "use_data_before_expert_parallelism": False,
    "log_level": None,
    "vocabulary_size": None,
    "sequence_parallel_size": 1,
    "optimizer": None,
    "scheduler": None,
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.enabled": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
    "torch_autocast.enabled": False,
    "torch_autocast.dtype": None,
    "torch_autocast.lower_precision_safe_modules": None,
    "data_types.grad_accum_dtype": None,
    "data_types.param_dtype": None,
    "data_types.buffer_dtype": None,
    "data_types.keep_in_fp32_modules": "auto",
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.offload_param": None,
    "zero_optimization.offload_optimizer": None,
    "zero_optimization.zenflow": None,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_model_persistence_threshold": MAXSIZE,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_allgather_sequential": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.parameter_alignment": False,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.enable_sanity_checks": False,
    "zero_optimization.save_muon_momentum_buffer_in_memory": False,
    "zero_optimization.leaf_module.names": [],
    "zero_optimization.leaf_module.name_suffixes": [],
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.profile": False,
    "activation_checkpointing.synchronize_checkpoint_boundary": False,
    "pipeline.stages": "auto",
    "pipeline.partition": "best",
    "pipeline.seed_layers": False,
    "pipeline.activation_checkpoint_interval": 0,
    "pipeline.pipe_partitioned": True,
    "pipeline.grad_partitioned": True,
    "checkpoint.tag_validation": "WARN",
    "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False,
    "checkpoint.parallel_write.pipeline_stage": False,
    "checkpoint.checkpoint_serialization": True,
    "checkpoint.writer": None,
    "comms_logger.enabled": False,
    "comms_logger.verbose": False,
    "comms_logger.prof_all": True,
    "comms_logger.debug": False,
    "comms_logger.prof_ops": [],
    "tensorboard.enabled": False,
    "tensorboard.output_path": "",
    "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.enabled": False,
    "csv_monitor.output_path": "",
    "csv_monitor.job_name": "DeepSpeedJobName",
    "wandb.enabled": False,
    "wandb.group": None,
    "wandb.team": None,
    "wandb.project": "deepspeed",
    "comet.enabled": False,
    "comet.samples_log_interval": 100,
    "comet.project": None,
    "comet.workspace": None,
    "comet.api_key": None,
    "comet.experiment_name": None,
    "comet.experiment_key": None,
    "comet.online": None,
    "comet.mode": None,
    "flops_profiler.enabled": False,
    "flops_profiler.recompute_fwd_factor": 0.0,
    "flops_profiler.profile_step": 1,
    "flops_profiler.module_depth": -1,
    "flops_profiler.top_modules": 1,
    "flops_profiler.detailed": True,
    "flops_profiler.output_file": None,
    "timers.throughput.enabled": True,
    "timers.throughput.synchronized": True,
    "aio.block_size": 1048576,
    "aio.queue_depth": 8,
    "aio.intra_op_parallelism": 1,
    "aio.single_submit": False,
    "aio.overlap_events": True,
    "aio.use_gds": False,
}


def lookup(obj, path):
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)  # aliases are attributes too
    return obj


def nested(path, value):
    out = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


@pytest.fixture(scope="module")
def default_cfg():
    return DeepSpeedConfig(BASE, world_size=1)


@pytest.mark.parametrize("path", sorted(DEFAULTS))
def test_default_matches_deepspeed_0_19_8(default_cfg, path):
    assert lookup(default_cfg.model, path) == DEFAULTS[path]


@pytest.mark.parametrize("path", sorted(p for p, v in DEFAULTS.items() if v is not None or "." in p))
def test_every_documented_key_parses_with_its_default_written_out(path):
    value = DEFAULTS[path]
    cfg = DeepSpeedConfig({**BASE, **nested(path, value)}, world_size=1)
    assert lookup(cfg.model, path) == value
    assert cfg.is_set(path) is (value != "auto")  # "auto" never counts as set


def test_defaults_cover_every_scalar_key():
    """Every leaf key of the schema is in DEFAULTS (or is a deliberate exception below)."""
    from deepspeed.runtime.config.sections.base import model_in
    from deepspeed.runtime.config.sections.unsupported import UNSUPPORTED_SECTIONS

    def leaves(model, prefix=""):
        for name, info in model.model_fields.items():
            key = info.alias or name
            child = model_in(info.annotation)
            if child is not None and not (info.default is None and info.default_factory is None):
                yield from leaves(child, f"{prefix}{key}.")
            else:
                yield prefix + key

    skip = set(UNSUPPORTED_SECTIONS) | {"train_batch_size", "train_micro_batch_size_per_gpu", "allgather_size",
                                        "elasticity",  # a free-form section checked by deepspeed.elasticity
                                        "gradient_accumulation_steps", "pipeline.use_reentrant",
                                        "zero_optimization.overlap_comm", "zero_optimization.mics_shard_size",
                                        "zero_optimization.mics_hierarchical_params_gather",
                                        "zero_optimization.zeropp_loco_param", "zero_optimization.leaf_module.classes",
                                        "aio.thread_count",  # legacy key Lightning writes; upstream ignores it
                                        "checkpoint.async_save",  # this build's own key (default False)
                                        "tensor_parallel.tensor_parallel"}  # attribute `tp`: inference sub-section
    missing = [leaf for leaf in leaves(RootConfig) if leaf not in DEFAULTS and leaf not in skip]
    assert missing == []


def test_every_field_has_a_docstring():
    from deepspeed.runtime.config.sections.base import model_in

    def undocumented(model, prefix=""):
        for name, info in model.model_fields.items():
            if not info.description:
                yield prefix + name
            child = model_in(info.annotation)
            if child is not None:
                yield from undocumented(child, f"{prefix}{name}.")

    assert list(undocumented(RootConfig)) == []


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage, expected):
    cfg = DeepSpeedConfig({**BASE, "zero_optimization": {"stage": stage}}, world_size=1)
    assert cfg.model.zero_optimization.overlap_comm is expected
    explicit = DeepSpeedConfig({**BASE, "zero_optimization": {"stage": stage, "overlap_comm": not expected}},
                               world_size=1)
    assert explicit.model.zero_optimization.overlap_comm is (not expected)


def test_leaf_module_defaults_and_string_coercion(default_cfg):
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in \
        default_cfg.model.zero_optimization.leaf_module.classes
    cfg = DeepSpeedConfig({**BASE, "zero_optimization": {"leaf_module": {"classes": "MyBlock", "names": ["a", "a"]}}},
                          world_size=1)
    assert cfg.model.zero_optimization.leaf_module.classes == ["MyBlock"]
    assert cfg.model.zero_optimization.leaf_module.names == ["a"]


# ------------------------------------------------------------------------------ sources
CONFIG = {"train_batch_size": 8, "fp16": {"enabled": True}}


def test_dict_source_is_kept_and_not_mutated():
    user = {"train_batch_size": 8, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2,
            "reduce_bucket_size": "auto", "cpu_offload": True}, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}
    snapshot = json.loads(json.dumps(user))
    cfg = DeepSpeedConfig(user, world_size=2)
    assert cfg.raw is user and user == snapshot
    assert cfg._param_dict is user


def test_json_file_and_path_objects(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    for source in (str(path), path):
        cfg = DeepSpeedConfig(source, world_size=1)
        assert cfg.model.fp16.enabled and cfg.raw == CONFIG


def test_json_string_and_base64():
    text = json.dumps(CONFIG)
    assert DeepSpeedConfig(text, world_size=1).raw == CONFIG
    for encoded in (base64.urlsafe_b64encode(text.encode()), base64.b64encode(text.encode())):
        assert load_config_dict(encoded.decode()) == CONFIG
    unpadded = base64.urlsafe_b64encode(b'{"train_batch_size": 4}').decode().rstrip("=")
    assert load_config_dict(unpadded) == {"train_batch_size": 4}


@pytest.mark.parametrize("text,key", [
    ('{"train_batch_size": 8, "train_batch_size": 16}', "'train_batch_size'"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}', "'stage'"),
])
def test_duplicate_keys_are_rejected(tmp_path, text, key):
    path = tmp_path / "dup.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(str(path), world_size=1)
    assert f"config file {path}: duplicate key(s) in DeepSpeed config: {key}" in str(info.value)
    with pytest.raises(DeepSpeedConfigError, match="duplicate key"):
        load_config_dict(text)


@pytest.mark.parametrize("source,message", [
    ("missing/ds_config.json", "file not found"),
    ("no such thing", "neither an existing file, a JSON object, nor base64 JSON"),
    ('{"train_batch_size": 8,', "config JSON string is not valid JSON"),
    ("[1, 2]", "neither an existing file"),
    (42, "config must be a dict, a path to a JSON file, a JSON string or base64-encoded JSON; got int"),
])
def test_bad_sources(source, message):
    with pytest.raises(DeepSpeedConfigError) as info:
        load_config_dict(source)
    assert message in str(info.value)


def test_json_file_holding_a_list(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1]")
    with pytest.raises(DeepSpeedConfigError, match="must hold a JSON object, got list"):
        load_config_dict(str(path))


# ------------------------------------------------------------------------------ real-world values
def test_infinity_steps_per_print_means_never():
    cfg = DeepSpeedConfig('{"train_batch_size": 8, "steps_per_print": Infinity}', world_size=1)
    assert cfg.model.steps_per_print is None
    assert DeepSpeedConfig({**BASE, "steps_per_print": 10}, world_size=1).model.steps_per_print == 10


def test_scientific_notation_for_int_fields():
    cfg = DeepSpeedConfig('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8,'
                          ' "allgather_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7}}', world_size=1)
    zero = cfg.model.zero_optimization
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.prefetch_bucket_size) == (
        200_000_000, 500_000_000, 50_000_000)
    assert type(zero.reduce_bucket_size) is int


def test_offload_device_none_and_null_nvme_path():
    cfg = DeepSpeedConfig({**BASE, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "none", "nvme_path": None},
        "offload_optimizer": {"device": "cpu", "nvme_path": None, "pin_memory": True}}}, world_size=1)
    zero = cfg.model.zero_optimization
    assert zero.offload_param.device == "none" and not zero.offload_param.enabled
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.enabled
    assert zero.offload_optimizer.nvme_path is None


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def text(self, level):
        return "\n".join(r.getMessage() for r in self.records if r.levelno == level)


@pytest.fixture
def logs():
    handler = Capture()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.setLevel(old)
    logger.removeHandler(handler)


HF_CONFIG = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "offload_optimizer": {"device": "auto"}},
}


def test_hugging_face_auto_takes_defaults_and_logs(logs):
    cfg = DeepSpeedConfig(HF_CONFIG, world_size=2)
    m = cfg.model
    assert (m.gradient_clipping, m.fp16.enabled, m.fp16.initial_scale_power) == (1.0, False, 16)
    assert m.optimizer.params == {"weight_decay": 0.01} and m.scheduler.params == {}
    assert m.zero_optimization.reduce_bucket_size == 500_000_000
    assert m.zero_optimization.offload_optimizer.device == "none"
    assert "zero_optimization.stage3_prefetch_bucket_size" in cfg.auto_keys
    assert not cfg.is_set("zero_optimization.reduce_bucket_size") and cfg.is_set("zero_optimization.stage")
    info = logs.text(logging.INFO)
    assert 'zero_optimization.reduce_bucket_size: "auto" left unresolved; using the default 500000000' in info
    assert 'optimizer.params.lr: "auto" dropped' in info


def test_auto_inside_a_list_is_left_alone():
    cfg = DeepSpeedConfig({**BASE, "comms_logger": {"prof_ops": ["auto"]}}, world_size=1)
    assert cfg.model.comms_logger.prof_ops == ["auto"]


@pytest.mark.parametrize("spelling,dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                            ("torch.bfloat16", torch.bfloat16), ("float16", torch.float16),
                                            ("fp16", torch.float16), ("half", torch.float16)])
def test_torch_autocast_dtype_spellings(spelling, dtype):
    cfg = DeepSpeedConfig({**BASE, "torch_autocast": {"enabled": True, "dtype": spelling,
                                                      "lower_precision_safe_modules": ["torch.nn.Linear"]}},
                          world_size=1)
    assert cfg.model.torch_autocast.dtype is dtype
    assert cfg.model.torch_autocast.lower_precision_safe_modules == ["torch.nn.Linear"]
    assert cfg.to_dict()["torch_autocast"]["dtype"] == str(dtype).replace("torch.", "")


@pytest.mark.parametrize("spelling,name,dtype", [("fp32", "fp32", torch.float32), ("FP16", "fp16", torch.float16),
                                                 ("bfloat16", "bf16", torch.bfloat16), (None, None, None)])
def test_communication_data_type(spelling, name, dtype):
    cfg = DeepSpeedConfig({**BASE, "communication_data_type": spelling}, world_size=1)
    assert (cfg.model.communication_data_type, cfg.communication_dtype) == (name, dtype)
    assert cfg.communication_data_type is dtype  # upstream attribute is a torch.dtype


def test_legacy_spellings(logs):
    cfg = DeepSpeedConfig({**BASE, "bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True, "cpu_offload": True}}, world_size=1)
    zero = cfg.model.zero_optimization
    assert cfg.model.bf16.enabled and cfg.is_set("bf16.enabled")
    assert zero.gather_16bit_weights_on_model_save and zero.offload_optimizer.device == "cpu"
    warnings = logs.text(logging.WARNING)
    assert "zero_optimization.cpu_offload is deprecated; use offload_optimizer instead" in warnings
    old = DeepSpeedConfig({**BASE, "zero_optimization": True, "allgather_size": 1e8}, world_size=1)
    assert (old.model.zero_optimization.stage, old.model.zero_optimization.allgather_bucket_size) == (1, 100_000_000)
    assert DeepSpeedConfig({**BASE, "zero_optimization": False}, world_size=1).model.zero_optimization.stage == 0


@pytest.mark.parametrize("value,expected", [("Ignore", "IGNORE"), ("warn", "WARN"), ("FAIL", "FAIL")])
def test_tag_validation_is_case_insensitive(value, expected):
    cfg = DeepSpeedConfig({**BASE, "checkpoint": {"tag_validation": value}}, world_size=1)
    assert cfg.model.checkpoint.tag_validation == expected
    assert cfg.checkpoint_tag_validation_enabled is (expected != "IGNORE")
    assert cfg.checkpoint_tag_validation_fail is (expected == "FAIL")


def test_null_section_means_default():
    cfg = DeepSpeedConfig({**BASE, "fp16": None, "zero_optimization": None, "optimizer": None, "bfloat16": None,
                           "communication_data_type": None, "steps_per_print": None}, world_size=1)
    assert not cfg.model.fp16.enabled and cfg.model.zero_optimization.stage == 0 and cfg.model.optimizer is None
    assert cfg.model.steps_per_print is None and cfg.model.communication_data_type is None


def test_null_scalar_does_not_silently_take_the_default():
    with pytest.raises(DeepSpeedConfigError, match="gradient_clipping: got null; expected a number"):
        DeepSpeedConfig({**BASE, "gradient_clipping": None}, world_size=1)


# ------------------------------------------------------------------------------ engine-facing API
FULL = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR"},
    "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "stage3_max_live_parameters": 1e8},
    "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
    "checkpoint": {"load_universal": True}, "wall_clock_breakdown": True,
}


def test_engine_api():
    cfg = DeepSpeedConfig(FULL, world_size=4)
    m = cfg.model
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 2, 4)
    assert (m.train_batch_size, cfg.world_size) == (32, 4)
    assert (m.optimizer.type, m.optimizer.name, m.optimizer.params) == ("AdamW", "adamw", {"lr": 1e-3})
    assert (m.scheduler.type, m.scheduler.params) == ("WarmupLR", {})
    assert m.data_types.grad_accum_dtype == "fp32" and m.comms_logger.prof_ops == ["all_reduce"]
    assert isinstance(m.zero_optimization, ZeroConfig) and m.zero_optimization.max_live_parameters == 100_000_000
    assert m.zero_optimization.stage3_max_live_parameters == 100_000_000
    assert cfg.is_set("zero_optimization.max_live_parameters") and cfg.is_set("zero_optimization.stage3_max_live_parameters")
    assert not cfg.is_set("zero_optimization.reduce_bucket_size") and not cfg.is_set("fp16.enabled")
    assert not cfg.is_set("zero_optimization.stage.deeper") and not cfg.is_set("nonexistent")
    # upstream attribute names
    assert cfg.zero_config is m.zero_optimization and cfg.zero_optimization_stage == 2 and cfg.zero_enabled
    assert cfg.bfloat16_config.enabled and not cfg.float16_config.enabled
    assert (cfg.optimizer_name, cfg.optimizer_params, cfg.scheduler_name) == ("adamw", {"lr": 1e-3}, "WarmupLR")
    assert cfg.load_universal_checkpoint and cfg.steps_per_print == 5 and cfg.wall_clock_breakdown
    assert cfg.pipeline["pipe_partitioned"] is True and m.checkpoint["load_universal"] is True
    assert "zero_stage=2" in repr(cfg)
    with pytest.raises(AttributeError):
        cfg.no_such_attribute


def test_optimizer_name_keeps_torch_names():
    cfg = DeepSpeedConfig({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, world_size=1)
    assert cfg.optimizer_name == "SGD"
    assert DeepSpeedConfig(BASE, world_size=1).optimizer_name is None


def test_to_dict_is_json_and_round_trips():
    cfg = DeepSpeedConfig({**FULL, "torch_autocast": {"dtype": "bf16"}, "steps_per_print": float("inf")}, world_size=4)
    resolved = cfg.to_dict()
    text = json.dumps(resolved, allow_nan=False)
    assert resolved["train_batch_size"] == 32 and resolved["zero_optimization"]["overlap_comm"] is True
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    again = DeepSpeedConfig(json.loads(text), world_size=4, strict=True)
    assert again.to_dict() == resolved


def test_print_config_logs_resolved_values(logs):
    DeepSpeedConfig(FULL, world_size=4).print_config()
    assert '"train_batch_size": 32' in logs.text(logging.INFO)


def test_upstream_zero_class_names():
    assert DeepSpeedZeroConfig is ZeroConfig
    assert DeepSpeedZeroOffloadOptimizerConfig is OffloadOptimizerConfig
    assert DeepSpeedZeroOffloadParamConfig is OffloadParamConfig
    zero = DeepSpeedZeroConfig(stage=3, stage3_param_persistence_threshold="auto", cpu_offload_param=True)
    assert zero.param_persistence_threshold == 100_000 and zero.offload_param.device == "cpu"


def test_sections_validate_assignment():
    cfg = DeepSpeedConfig(BASE, world_size=1)
    cfg.model.zero_optimization.reduce_bucket_size = 1e6
    assert cfg.model.zero_optimization.reduce_bucket_size == 1_000_000
    with pytest.raises(ValueError):
        cfg.model.zero_optimization.stage = 7


def test_importable_from_deepspeed_namespace():
    import deepspeed

    assert deepspeed.DeepSpeedConfig is DeepSpeedConfig and deepspeed.DeepSpeedConfigError is DeepSpeedConfigError


def test_docs_mention_every_key():
    """docs/config.md is the user reference: every accepted key must appear in it."""
    from pathlib import Path

    from deepspeed.runtime.config.sections.base import model_in, field_keys

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()

    def keys(model):
        for key, name in field_keys(model).items():
            if key == (model.model_fields[name].alias or name):
                yield key
                child = model_in(model.model_fields[name].annotation)
                if child is not None:
                    yield from keys(child)

    assert sorted({k for k in keys(RootConfig) if f"`{k}`" not in docs and f".{k}`" not in docs}) == []


HF_ZERO3_OFFLOAD = """{
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true}, "overlap_comm": true, "contiguous_gradients": true,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true},
  "gradient_accumulation_steps": 2, "gradient_clipping": "auto", "steps_per_print": 2000,
  "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": false
}"""

CLASSIC_ZERO2 = """{
  "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 100,
  "optimizer": {"type": "OneBitAdam", "params": {"lr": 2e-4, "freeze_step": 400, "cuda_aware": false}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100}},
  "gradient_clipping": 1.0, "prescale_gradients": false,
  "fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
           "initial_scale_power": 15},
  "zero_optimization": {"stage": 2, "allgather_partitions": true, "allgather_bucket_size": 2e8,
    "overlap_comm": true, "reduce_scatter": true, "reduce_bucket_size": 2e8, "contiguous_gradients": true,
    "cpu_offload": false},
  "activation_checkpointing": {"partition_activations": false, "contiguous_memory_optimization": false,
    "cpu_checkpointing": false, "number_checkpoints": null, "synchronize_checkpoint_boundary": false,
    "profile": false},
  "tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "bert"},
  "flops_profiler": {"enabled": false, "profile_step": 1, "module_depth": -1, "top_modules": 3, "detailed": true},
  "wall_clock_breakdown": false
}"""


@pytest.mark.parametrize("text", [HF_ZERO3_OFFLOAD, CLASSIC_ZERO2])
def test_real_world_configs_load_strictly(text):
    cfg = DeepSpeedConfig(text, world_size=2, strict=True)
    assert cfg.model.zero_optimization.overlap_comm is True
    assert cfg.model.zero_optimization.stage in (2, 3) and cfg.train_batch_size in (16, 64)


def test_hjson_config_file(tmp_path):
    # upstream reads config files with hjson (comments, unquoted keys); ours does when hjson is installed
    hjson = pytest.importorskip("hjson")
    path = tmp_path / "ds_config.json"
    path.write_text("{\n  # comment\n  train_batch_size: 8\n  bf16: {enabled: true}\n}\n")
    assert load_config_dict(str(path)) == {"train_batch_size": 8, "bf16": {"enabled": True}}
    path.write_text(hjson.dumps({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    assert load_config_dict(str(path))["optimizer"]["params"]["lr"] == 1e-3
    path.write_text("{\n  train_batch_size: 8\n  train_batch_size: 4\n}\n")
    with pytest.raises(DeepSpeedConfigError, match="duplicate key"):
        load_config_dict(str(path))
    path.write_text("{ train_batch_size: [ }")
    with pytest.raises(DeepSpeedConfigError, match="neither valid JSON"):
        load_config_dict(str(path))


def test_unmanaged_gradient_accumulation_refuses_overlap_comm_below_stage_2():
    # upstream's rule (reduction moves to step() at stages 0-1); a config valid here stays valid there
    from deepspeed.runtime.engine_setup import check_supported
    from deepspeed.runtime.errors import UsageError

    unmanaged = {**BASE, "managed_gradient_accumulation": False}
    check_supported(DeepSpeedConfig(unmanaged, world_size=1))
    for stage in (2, 3):
        check_supported(DeepSpeedConfig({**unmanaged, "zero_optimization": {"stage": stage, "overlap_comm": True}},
                                        world_size=1))
    for stage in (0, 1):
        with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2"):
            check_supported(DeepSpeedConfig({**unmanaged, "zero_optimization": {"stage": stage, "overlap_comm": True}},
                                            world_size=1))
    with pytest.raises(UsageError):
        check_supported(DeepSpeedConfig({**unmanaged, "zero_optimization": {"stage": 1, "overlap_comm": True}},
                                        world_size=1))


def test_data_types_param_dtype_must_match_the_precision_flags():
    DeepSpeedConfig({**BASE, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}, world_size=1)
    for cfg in ({"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}},
                {"data_types": {"param_dtype": "bf16"}},
                {"fp16": {"enabled": True}, "data_types": {"param_dtype": "fp32"}}):
        with pytest.raises(AssertionError, match="data_types.param_dtype"):   # also a DeepSpeedConfigError
            DeepSpeedConfig({**BASE, **cfg}, world_size=1)


def test_cast_module_keeps_buffers_unless_buffer_dtype():
    from deepspeed.runtime.engine_setup import cast_module

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.LayerNorm(4)))
        m.register_buffer("inv_freq", torch.ones(4))
        m[1].register_buffer("steps", torch.zeros(1, dtype=torch.int64))
        m[1][0].register_buffer("table", torch.ones(2))
        return m

    m = model()
    cast_module(m, torch.bfloat16, None)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.inv_freq.dtype == torch.float32 and m[1][0].table.dtype == torch.float32
    m = model()
    cast_module(m, torch.bfloat16, torch.bfloat16)
    assert m.inv_freq.dtype == torch.bfloat16 and m[1][0].table.dtype == torch.bfloat16
    assert m[1].steps.dtype == torch.int64   # integer buffers never cast
    m = model()
    cast_module(m, torch.bfloat16, torch.bfloat16, ["1"])   # module "1" and below stay fp32
    assert m.inv_freq.dtype == torch.bfloat16 and m[1][0].table.dtype == torch.float32
    m = model()
    m._keep_in_fp32_modules = ["1"]   # "auto": the model's own list (Hugging Face attribute)
    cast_module(m, torch.bfloat16, torch.bfloat16)
    assert m[1][0].table.dtype == torch.float32


def test_engine_mixed_precision_methods_on_a_stand_in():
    """Upstream's engine has these three steps as methods that its tests (and subclasses) call with
    any object holding `_config`, the precision flags and `module`; ours are bound the same way."""
    import types

    from deepspeed.runtime.engine import DeepSpeedEngine

    def stand_in(param_dtype=None, buffer_dtype=None, fp16=False, bf16=False, module=None):
        return types.SimpleNamespace(_config=types.SimpleNamespace(param_dtype=param_dtype, buffer_dtype=buffer_dtype),
                                     fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16, module=module)

    assert DeepSpeedEngine._mixed_precision_dtypes(stand_in(bf16=True)) == (torch.bfloat16, None)
    assert DeepSpeedEngine._mixed_precision_dtypes(stand_in(fp16=True, buffer_dtype="fp32")) == (torch.float16,
                                                                                               torch.float32)
    assert DeepSpeedEngine._mixed_precision_dtypes(stand_in()) == (None, None)
    DeepSpeedEngine._assert_valid_mixed_precision_config(stand_in(param_dtype="bf16", bf16=True))
    with pytest.raises(AssertionError, match="param_dtype='fp32' conflicts with the training precision 'bf16'"):
        DeepSpeedEngine._assert_valid_mixed_precision_config(stand_in(param_dtype="fp32", bf16=True))
    m = torch.nn.Linear(2, 2)
    m.register_buffer("inv_freq", torch.ones(2))
    DeepSpeedEngine._cast_module_mixed_precision(stand_in(module=m), torch.bfloat16, None, True)   # zero.Init owns params
    assert m.weight.dtype == torch.float32 and m.inv_freq.dtype == torch.float32
    DeepSpeedEngine._cast_module_mixed_precision(stand_in(module=m), None, torch.bfloat16, False)
    assert m.weight.dtype == torch.float32 and m.inv_freq.dtype == torch.bfloat16


def test_data_types_read_through_upstream_attribute_names():
    cfg = DeepSpeedConfig({**BASE, "bf16": {"enabled": True},
                           "data_types": {"param_dtype": "bf16", "buffer_dtype": "fp32", "grad_accum_dtype": "fp32"}},
                          world_size=1)
    assert (cfg.param_dtype, cfg.buffer_dtype, cfg.grad_accum_dtype) == ("bf16", "fp32", "fp32")
    plain = DeepSpeedConfig(BASE, world_size=1)
    assert (plain.param_dtype, plain.buffer_dtype) == (None, None)
