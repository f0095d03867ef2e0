"""Every config error names the key path, the value and what is allowed; unknown keys get hints."""

import logging
import string

import pytest

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.config.errors import edit_distance, is_near_miss, suggest
from deepspeed.runtime.config.root import KNOWN_TOP_LEVEL
from deepspeed.utils.logging import logger

BASE = {"train_batch_size": 8}


def errors_of(config, **kwargs):
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({**BASE, **config}, world_size=1, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


# ------------------------------------------------------------------------------ types and ranges
TYPE_ERRORS = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: got 4; expected one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": "two"}}, 'zero_optimization.stage: got "two"; expected one of 0, 1, 2, 3'),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage: got true; expected a number, not a boolean"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size: got -1; expected a value > 0"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size: got 0; expected a value > 0"),
    ({"zero_optimization": {"allgather_bucket_size": -5e8}},
     "zero_optimization.allgather_bucket_size: got -500000000.0; expected a value >= 0"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
     "zero_optimization.stage3_prefetch_bucket_size: got -1; expected a value >= 0"),
    ({"zero_optimization": {"sub_group_size": 2.5}},
     "zero_optimization.sub_group_size: got 2.5; expected an integer (no fractional part)"),
    ({"zero_optimization": {"overlap_comm": "sometimes"}},
     'zero_optimization.overlap_comm: got "sometimes"; expected true or false'),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device: got \"gpu\"; expected one of 'none', 'cpu', 'nvme'"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio: got 1.5; expected a value <= 1"),
    ({"gradient_clipping": -1}, "gradient_clipping: got -1; expected a number >= 0 (0 disables clipping)"),
    ({"gradient_clipping": "big"}, 'gradient_clipping: got "big"; expected a number'),
    ({"gradient_clipping": float("inf")}, "gradient_clipping: got Infinity; expected a finite number"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor: got 0; expected a value > 0"),
    ({"gradient_predivide_factor": -2.0}, "gradient_predivide_factor: got -2.0; expected a value > 0"),
    ({"steps_per_print": 0}, "steps_per_print: got 0; expected an integer >= 1 (null or Infinity: never print)"),
    ({"steps_per_print": 2.5}, "steps_per_print: got 2.5; expected an integer (no fractional part)"),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: got -1; expected a value >= 0"),
    ({"fp16": {"initial_scale_power": 200}}, "fp16.initial_scale_power: got 200; expected a value <= 127"),
    ({"fp16": {"initial_scale_power": -1}}, "fp16.initial_scale_power: got -1; expected a value >= 0"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis: got 0; expected a value >= 1"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}},
     "fp16.loss_scale_window: got 0; must be >= 1 with dynamic loss scaling"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}},
     "fp16.min_loss_scale: got 0; must be > 0 with dynamic loss scaling"),
    ({"fp16": {"enabled": "maybe"}}, 'fp16.enabled: got "maybe"; expected true or false'),
    ({"fp16": True}, "fp16: got true; expected an object"),
    ({"bf16": {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": False}},
     "bf16.bf16_optimizer_states: requires bf16_master_weights_and_grads: true"),
    ({"communication_data_type": "fp8"}, 'communication_data_type: got "fp8"; expected one of "fp32", "float32"'),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op: Invalid gradient_allreduce_op 'max': expected 'mean' or 'sum'"),
    ({"checkpoint": {"tag_validation": "sometimes"}},
     "checkpoint.tag_validation: got \"SOMETIMES\"; expected one of 'IGNORE', 'WARN', 'FAIL'"),
    ({"checkpoint": {"parallel_write": {"pipeline_stage": "yes please"}}},
     'checkpoint.parallel_write.pipeline_stage: got "yes please"; expected true or false'),
    ({"torch_autocast": {"dtype": "fp32"}},
     'torch_autocast.dtype: got "fp32"; expected one of "fp16", "float16", "half", "torch.float16", "bf16"'),
    ({"torch_autocast": {"lower_precision_safe_modules": "torch.nn.Linear"}},
     'torch_autocast.lower_precision_safe_modules: got "torch.nn.Linear"; expected a list'),
    ({"data_types": {"grad_accum_dtype": "int8"}}, 'data_types.grad_accum_dtype: got "int8"; expected one of'),
    ({"data_types": {"keep_in_fp32_modules": "all"}},
     'data_types.keep_in_fp32_modules: got "all"; expected "auto" or a list of module name patterns'),
    ({"optimizer": {"params": {"lr": 0.1}}}, "optimizer.type: required key missing"),
    ({"scheduler": {"type": 3}}, "scheduler.type: got 3; expected a string"),
    ({"log_level": "loud"}, 'log_level: got "loud"; expected one of debug, info, warning, error, critical'),
    ({"pipeline": {"stages": 0}}, 'pipeline.stages: got 0; expected "auto" or an integer >= 1'),
    ({"activation_checkpointing": {"number_checkpoints": 0}},
     "activation_checkpointing.number_checkpoints: got 0; expected a value >= 1"),
    ({"comms_logger": {"prof_ops": "all_reduce"}}, 'comms_logger.prof_ops: got "all_reduce"; expected a list'),
    ({"comms_logger": {"prof_ops": [1]}}, "comms_logger.prof_ops[0]: got 1; expected a string"),
]


@pytest.mark.parametrize("config,message", TYPE_ERRORS)
def test_type_and_range_errors(config, message):
    assert message in str(errors_of(config))


CROSS_ERRORS = [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled; enable at most one"),
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}},
     "torch_autocast.enabled: cannot be combined with bf16.enabled"),
    ({"fp16": {"enabled": True}, "torch_autocast": {"enabled": True}},
     "torch_autocast.enabled: cannot be combined with fp16.enabled"),
    ({"fp16": {"fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads: requires zero_optimization.stage 1, 2 or 3, got stage 0"),
    ({"bf16": {"bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads: requires zero_optimization.stage 1, 2 or 3, got stage 0"),
    ({"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 3}},
     'gradient_allreduce_op: "sum" is not supported with ZeRO stage 3 (zero_optimization.stage 3)'),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: parameter offload needs stage 3, got stage 2"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: optimizer offload needs stage 1, 2 or 3, got stage 0"),
    ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
     "zero_optimization.compute_grad_norm: false is supported only with stage 1 or 2, got stage 3"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload: deprecated alias of offload_optimizer; give only offload_optimizer"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                            "stage3_gather_16bit_weights_on_model_save": True}},
     "zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated alias of "
     "stage3_gather_16bit_weights_on_model_save"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16: legacy spelling of bf16; give only bf16"),
]


@pytest.mark.parametrize("config,message", CROSS_ERRORS)
def test_cross_field_errors(config, message):
    assert message in str(errors_of(config))


def test_valid_neighbours_of_the_cross_field_errors_load():
    for config in ({"fp16": {"enabled": True}, "bf16": {"enabled": False}},
                   {"torch_autocast": {"enabled": True, "dtype": "bf16"}},
                   {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                    "zero_optimization": {"stage": 1}},
                   {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                   {"zero_optimization": {"stage": 2, "compute_grad_norm": False}},
                   {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2}},
                   {"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}}):
        DeepSpeedConfig({**BASE, **config}, world_size=1)


def test_all_problems_in_one_exception():
    exc = errors_of({"zero_optimization": {"stage": 4, "overlap_com": True}, "gradient_clipping": -1,
                     "zero_optimisation": {}, "amp": {"enabled": True}, "train_micro_batch_size_per_gpu": 3},
                    )
    assert len(exc.errors) == 6, exc.errors
    text = str(exc)
    assert text.startswith("6 problems in the DeepSpeed config:")
    assert "train_batch_size (8) is not divisible by train_micro_batch_size_per_gpu (3)" in text
    assert all(line.count("\n") == 0 for line in exc.errors)


def test_single_problem_is_the_whole_message():
    assert str(errors_of({"gradient_clipping": -1})) == \
        "gradient_clipping: got -1; expected a number >= 0 (0 disables clipping)"


# ------------------------------------------------------------------------------ unknown keys
def typos(key):
    """Single-character typos at the middle of `key`: deletion, substitution, insertion, swap."""
    i = len(key) // 2
    other = next(c for c in "xqz" if c != key[i])
    out = {key[:i] + key[i + 1:], key[:i] + other + key[i + 1:], key[:i] + "x" + key[i:]}
    if key[i - 1] != key[i]:
        out.add(key[:i - 1] + key[i] + key[i - 1] + key[i + 1:])
    return sorted(t for t in out if t not in KNOWN_TOP_LEVEL)


@pytest.mark.parametrize("key", sorted(KNOWN_TOP_LEVEL))
def test_top_level_typos_are_errors_with_did_you_mean(key):
    for typo in typos(key):
        with pytest.raises(DeepSpeedConfigError) as info:
            DeepSpeedConfig({"train_batch_size": 8, typo: {}}, world_size=1)
        line = next(e for e in info.value.errors if e.startswith(typo + ":"))
        assert f"{typo}: unknown top-level key (did you mean " in line and repr(key) in line, line


def test_typo_at_every_position_and_letter():
    key = "train_micro_batch_size_per_gpu"
    for i in range(len(key)):
        for letter in string.ascii_lowercase[i % 3::3]:  # every letter somewhere, a third at each position
            typo = key[:i] + letter + key[i + 1:]
            if typo != key:
                assert key in suggest(typo, KNOWN_TOP_LEVEL), typo


@pytest.mark.parametrize("typo,expected", [("zero_optimisation", "zero_optimization"),
                                           ("train_batch_sise", "train_batch_size"),
                                           ("Train_Batch_Size", "train_batch_size"),
                                           ("gradient-clipping", "gradient_clipping"),
                                           ("bf_16", "bf16")])
def test_near_miss_spellings(typo, expected):
    exc = errors_of({typo: 1})
    assert f"{typo}: unknown top-level key (did you mean '{expected}'" in str(exc)


MISPLACED = [
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer: unknown top-level key; it belongs under zero_optimization"),
    ({"stage3_max_live_parameters": 1e9}, "stage3_max_live_parameters: unknown top-level key; it belongs under zero_optimization"),
    ({"initial_scale_power": 12}, "initial_scale_power: unknown top-level key; it belongs under fp16"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale: unknown key; it belongs under fp16"),
    ({"fp16": {"gradient_clipping": 1.0}}, "fp16.gradient_clipping: unknown key; it belongs at the top level"),
    ({"zero_optimization": {"overlap_com": True}}, "zero_optimization.overlap_com: unknown key (did you mean 'overlap_comm'?)"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
     "zero_optimization.offload_optimizer.devise: unknown key (did you mean 'device'?)"),
    ({"zero_optimization": {"stage3_prefetch_bucket": 1}},
     "zero_optimization.stage3_prefetch_bucket: unknown key (did you mean 'stage3_prefetch_bucket_size'?)"),
    ({"fp16": {"loss_scale_windows": 100}}, "fp16.loss_scale_windows: unknown key (did you mean 'loss_scale_window'?)"),
    ({"checkpoint": {"frequency": 10}}, "checkpoint.frequency: unknown key; allowed keys: async_save, "
                                        "checkpoint_serialization, "
                                        "load_universal, parallel_write, tag_validation, use_node_local_storage, writer"),
    ({"checkpoint": {"universal": True}}, "checkpoint.universal: unknown key (did you mean 'load_universal'?)"),
]


@pytest.mark.parametrize("config,message", MISPLACED)
def test_unknown_and_misplaced_keys(config, message):
    assert message in str(errors_of(config))


def test_suggestion_helpers():
    assert edit_distance("overlap_com", "overlap_comm") == 1
    assert edit_distance("fp61", "fp16") == 1  # a swap is one edit
    assert is_near_miss("zero_optimisation", "zero_optimization")
    assert not is_near_miss("my_experiment_name", "wall_clock_breakdown")
    assert set(suggest("ff16", ["fp16", "bf16", "zero_optimization"])) == {"fp16", "bf16"}
    assert suggest("completely_unrelated", ["fp16", "bf16"]) == []


# ------------------------------------------------------------------------------ strict mode
@pytest.fixture
def warnings():
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_unknown_top_level_key_warns_by_default(warnings, monkeypatch):
    monkeypatch.delenv("DS_STRICT_CONFIG", raising=False)
    cfg = DeepSpeedConfig({**BASE, "my_experiment_name": "run-7"}, world_size=1)
    assert "my_experiment_name" not in cfg.to_dict() and cfg.raw["my_experiment_name"] == "run-7"
    text = "\n".join(r.getMessage() for r in warnings)
    assert "unknown top-level key 'my_experiment_name' is ignored" in text and "DS_STRICT_CONFIG=1" in text


def test_strict_mode_by_argument_and_env(monkeypatch):
    monkeypatch.delenv("DS_STRICT_CONFIG", raising=False)
    assert "my_experiment_name: unknown top-level key (strict mode)" in str(
        errors_of({"my_experiment_name": "run-7"}, strict=True))
    monkeypatch.setenv("DS_STRICT_CONFIG", "1")
    errors_of({"my_experiment_name": "run-7"})
    DeepSpeedConfig({**BASE, "my_experiment_name": "run-7"}, world_size=1, strict=False)
    DeepSpeedConfig(BASE, world_size=1)  # strict mode alone does not reject valid configs


def test_non_string_key():
    with pytest.raises(DeepSpeedConfigError, match="1: config keys must be strings"):
        DeepSpeedConfig({**BASE, 1: "x"}, world_size=1)


# ------------------------------------------------------------------------------ not supported
NOT_SUPPORTED = [  # (key, enabled value, disabled value)
    ("autotuning", {"enabled": True}, {"enabled": False, "fast": True}),
    ("hybrid_engine", {"enabled": True}, {"enabled": False, "max_out_tokens": 512}),
    ("data_efficiency", {"enabled": True}, {"enabled": False}),
    ("compile", {"deepcompile": True}, {"deepcompile": False}),
    ("tensor_parallel", {"tp": {"tp_size": 2}}, {"autotp_size": 0}),
    ("expert_parallel", {"enabled": True, "expert_tensor_parallel_size": 2}, {"enabled": True}),
    ("weight_quantization", {"quantized_initialization": {}}, {"enabled": False}),
    ("datastates_ckpt", {}, False),
    ("nebula", {"enabled": True}, {"enabled": False}),
    ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}},
     {"weight_quantization": {"shared_parameters": {"enabled": False}}}),
    ("amp", {"enabled": True, "opt_level": "O1"}, {"enabled": False, "opt_level": "O1"}),
    ("quantize_training", {"enabled": True}, {"enabled": False}),
    ("eigenvalue", {"enabled": True}, {"enabled": False}),
    ("sparse_attention", {"mode": "fixed"}, None),
    ("graph_harvesting", True, False),
    ("curriculum_learning", {"enabled": True}, {"enabled": False}),
    ("progressive_layer_drop", {"enabled": True}, {"enabled": False}),
    ("sparse_gradients", True, False),
]


@pytest.mark.parametrize("key,enabled,disabled", NOT_SUPPORTED)
def test_unsupported_sections(key, enabled, disabled):
    DeepSpeedConfig({**BASE, key: disabled}, world_size=1)
    line = next(e for e in errors_of({key: enabled}).errors if e.startswith(key))
    assert "is not supported by this implementation (pure-Python deepspeed)" in line
    assert "remove it" in line or "set it to" in line


NOT_SUPPORTED_ZERO = [  # (zero_optimization keys when enabled, when disabled, error path)
    ({"zero_quantized_nontrainable_weights": True}, {}, "zero_optimization.zero_quantized_nontrainable_weights"),
    ({"mics_shard_size": 8}, {"mics_shard_size": -1}, "zero_optimization.mics_shard_size"),
    ({"mics_hierarchical_params_gather": True}, {}, "zero_optimization.mics_hierarchical_params_gather"),
    ({"zeropp_loco_param": {"err_beta": 0.8}}, {"zeropp_loco_param": None}, "zero_optimization.zeropp_loco_param"),
    ({"zenflow": {"topk_ratio": 0.1}}, {"zenflow": None}, "zero_optimization.zenflow"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, {"offload_optimizer": {"device": "cpu", "ratio": 1}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, {"offload_optimizer": {"super_offload": False}},
     "zero_optimization.offload_optimizer.super_offload"),
]


@pytest.mark.parametrize("enabled,disabled,path", NOT_SUPPORTED_ZERO)
def test_unsupported_zero_features(enabled, disabled, path):
    DeepSpeedConfig({**BASE, "zero_optimization": {"stage": 3, **disabled}}, world_size=1)
    text = str(errors_of({"zero_optimization": {"stage": 3, **enabled}}))
    assert f"{path}: " in text and "is not supported by this implementation (pure-Python deepspeed)" in text


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("key,value,shown", [("zero_quantized_gradients", True, "true"),
                                             ("zero_quantized_weights", True, "true")])
def test_zeropp_needs_stage_3(stage, key, value, shown):
    """qgZ and qwZ change stage 3's collectives; below stage 3 each is refused, naming key and value."""
    DeepSpeedConfig({**BASE, "zero_optimization": {"stage": 3, key: value}}, world_size=1)
    text = str(errors_of({"zero_optimization": {"stage": stage, key: value}}))
    assert f"zero_optimization.{key}: {shown} needs stage 3, got stage {stage}" in text


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hpz_below_stage_3_is_accepted_with_a_warning(stage, monkeypatch):
    """hpZ only partitions stage 3's parameters; upstream ignores it at lower stages (its own test builds
    DeepSpeedZeroConfig(zero_hpz_partition_size=4) at the default stage 0), so it is kept, and logged."""
    from deepspeed.runtime.config.sections import zero as zero_section
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    warned = []
    monkeypatch.setattr(zero_section.logger, "warning", lambda msg, *a: warned.append(msg % a if a else msg))
    config = DeepSpeedConfig({**BASE, "zero_optimization": {"stage": stage, "zero_hpz_partition_size": 2}},
                             world_size=1)
    assert config.model.zero_optimization.zero_hpz_partition_size == 2
    assert DeepSpeedZeroConfig(zero_hpz_partition_size=4).zero_hpz_partition_size == 4
    assert any(f"zero_hpz_partition_size=2 has no effect with stage {stage}" in w for w in warned), warned


def test_allgather_bucket_size_odd_at_stage_1_2_is_rejected_as_upstream():
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage in (1, 2):
        with pytest.raises(AssertionError, match="allgather_bucket_size must be a multiple of "
                                                 "nccl_start_alignment_factor"):
            DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": stage,
                                                                          "allgather_bucket_size": 1001}}, world_size=1)
    DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 2, "allgather_bucket_size": 1000}},
                    world_size=1)
    DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3, "allgather_bucket_size": 1001}},
                    world_size=1)


def test_nvme_offload_config_errors(tmp_path):
    """offload_optimizer nvme needs an existing writable nvme_path; aio use_gds is refused by name."""
    ok = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}}
    DeepSpeedConfig({**BASE, "zero_optimization": ok, "aio": {"thread_count": 4}}, world_size=1)
    missing = str(errors_of({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}))
    assert "zero_optimization.offload_optimizer.nvme_path: is required" in missing
    (tmp_path / "file").write_text("")
    below_file = str(errors_of({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "file" / "swap")}}}))
    assert "offload_optimizer.nvme_path:" in below_file and "swap' is not a directory and cannot be made" in below_file
    missing_ok = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "new" / "swap")}}
    DeepSpeedConfig({**BASE, "zero_optimization": missing_ok}, world_size=1)   # made at initialize, as upstream
    assert "aio.use_gds: " in str(errors_of({"aio": {"use_gds": True}}))
    # offload_param nvme: the same nvme_path rules; stage 3 only (as upstream), named by key
    param = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 10}
    DeepSpeedConfig({**BASE, "zero_optimization": {"stage": 3, "offload_param": param}}, world_size=1)
    missing = str(errors_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    assert "zero_optimization.offload_param.nvme_path: is required" in missing
    staged = str(errors_of({"zero_optimization": {"stage": 2, "offload_param": param}}))
    assert "zero_optimization.offload_param: parameter offload needs stage 3, got stage 2" in staged
