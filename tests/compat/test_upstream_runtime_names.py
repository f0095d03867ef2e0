"""Upstream DeepSpeed module paths and names its own unit tests (and downstream code) import:
runtime.constants, runtime.config readers, config_utils, precision_config, zero.offload_config,
zero.leaf_module_config, checkpoint.constants, runtime.utils, bf16_optimizer, OnDevice, utils.numa.
Behaviour, not just existence; the engine-level names are in tests/distributed/test_coalesce.py."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import List, Optional

import pytest
import torch
from pydantic import Field, ValidationError


def test_constants_agree_with_the_typed_config_defaults():
    from deepspeed.runtime import constants as C
    from deepspeed.runtime.config.root import RootConfig

    root = RootConfig()
    for key, default in [(C.GRADIENT_CLIPPING, C.GRADIENT_CLIPPING_DEFAULT), (C.LOG_LEVEL, C.LOG_LEVEL_DEFAULT),
                         (C.STEPS_PER_PRINT, C.STEPS_PER_PRINT_DEFAULT),
                         (C.PRESCALE_GRADIENTS, C.PRESCALE_GRADIENTS_DEFAULT),
                         (C.GRADIENT_PREDIVIDE_FACTOR, C.GRADIENT_PREDIVIDE_FACTOR_DEFAULT),
                         (C.WALL_CLOCK_BREAKDOWN, C.WALL_CLOCK_BREAKDOWN_DEFAULT),
                         (C.MEMORY_BREAKDOWN, C.MEMORY_BREAKDOWN_DEFAULT), (C.DUMP_STATE, C.DUMP_STATE_DEFAULT),
                         (C.DATALOADER_DROP_LAST, C.DATALOADER_DROP_LAST_DEFAULT),
                         (C.ZERO_ALLOW_UNTESTED_OPTIMIZER, C.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT),
                         (C.ZERO_FORCE_DS_CPU_OPTIMIZER, C.ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT),
                         (C.DISABLE_ALLGATHER, C.DISABLE_ALLGATHER_DEFAULT),
                         (C.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE, C.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT),
                         (C.COMMUNICATION_DATA_TYPE, C.COMMUNICATION_DATA_TYPE_DEFAULT)]:
        assert getattr(root, key) == default, key
    assert root.checkpoint.tag_validation == C.CHECKPOINT_TAG_VALIDATION_DEFAULT == C.ValidationMode.WARN
    assert root.checkpoint.load_universal == C.LOAD_UNIVERSAL_CHECKPOINT_DEFAULT
    from deepspeed.runtime.config.sections.optimizer import DEEPSPEED_OPTIMIZERS
    assert tuple(C.DEEPSPEED_OPTIMIZERS) == DEEPSPEED_OPTIMIZERS


def test_config_readers_and_optimizer_names():
    from deepspeed.runtime.config import (ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DeepSpeedConfig, get_gradient_clipping,
                                          get_log_level, get_optimizer_name, get_optimizer_params,
                                          get_scheduler_name)
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.optimizers import build_optimizer  # noqa: F401  (same names, one definition)
    from deepspeed.runtime import optimizers

    assert optimizers.ADAM_OPTIMIZER is ADAM_OPTIMIZER == "adam" and ADAMW_OPTIMIZER == "adamw"
    assert get_gradient_clipping({}) == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is LOG_LEVEL_DEFAULT is None and get_log_level({"log_level": "ERROR"}) == "ERROR"
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR"}}
    assert get_optimizer_name(cfg) == "Adam" and get_optimizer_params(cfg) == {"lr": 1e-3}
    assert get_scheduler_name(cfg) == "WarmupLR" and get_optimizer_name({}) is None
    # engine accessors read the DeepSpeedConfig attributes, as upstream's do
    fake = type("E", (), {"_config": type("C", (), {"log_level": "ERROR", "gradient_clipping": 0.5})()})()
    assert DeepSpeedEngine.log_level(fake) == "ERROR" and DeepSpeedEngine.gradient_clipping(fake) == 0.5
    ds = DeepSpeedConfig({"train_batch_size": 2, "log_level": "info"}, world_size=1)
    assert ds.gradient_clipping == 1.0 and ds.log_level == "info"


class _Conf:
    @staticmethod
    def make():
        from deepspeed.runtime.config_utils import DeepSpeedConfigModel

        class SimpleConf(DeepSpeedConfigModel):
            param_1: int = 0
            param_2_old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "param_2",
                                                                         "new_param_fn": (lambda x: [x])})
            param_2: Optional[List[str]] = None
            param_3: int = Field(0, alias="param_3_alias")
            name: str = "x"

        return SimpleConf


def test_deepspeed_config_model_deprecated_fields_aliases_extra():
    SimpleConf = _Conf.make()
    assert SimpleConf(param_1=42).param_1 == 42
    assert SimpleConf(param_2_old="DS").param_2 == ["DS"]
    assert SimpleConf(param_3=10).param_3 == SimpleConf(param_3_alias=10).param_3 == 10
    for bad in ({"param_1": "DS"}, {"param_2": "DS"}, {"param_1_typo": 0}):
        with pytest.raises(ValidationError):
            SimpleConf(**bad)
    with pytest.raises(AssertionError, match="together"):
        SimpleConf(param_2=["DS"], param_2_old="DS")
    assert SimpleConf(name="auto").name == "x"               # "auto": the default applies
    assert SimpleConf(strict=True, name="auto").name == "auto"  # strict keeps it
    c = SimpleConf()
    with pytest.raises(ValidationError):
        c.param_1 = "not an int"                               # assignments are validated


def test_config_utils_helpers():
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys, get_scalar_param

    assert get_scalar_param({"a": 1}, "a", 0) == 1 and get_scalar_param({}, "a", 0) == 0
    with pytest.raises(ValueError, match="Duplicate"):
        json.loads('{"a": 1, "a": 2}', object_pairs_hook=dict_raise_error_on_duplicate_keys)


def test_precision_config():
    from deepspeed.runtime.precision_config import (DeepSpeedBF16Config, DeepSpeedFP16Config, get_bfloat16_config,
                                                    get_float16_config)

    for bad in (-1, float("inf"), float("nan"), True):
        with pytest.raises(ValidationError):
            DeepSpeedFP16Config(loss_scale=bad)
    for bad in ([], {}):
        with pytest.raises(ValidationError, match="must be a number"):
            DeepSpeedFP16Config(loss_scale=bad)
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    with pytest.raises(ValidationError):
        DeepSpeedFP16Config(enabled=True, loss_scale=0, min_loss_scale=0)
    assert DeepSpeedFP16Config(enabled=True, loss_scale=128, min_loss_scale=0).min_loss_scale == 0
    for key in ("bf16", "bfloat16"):
        assert get_bfloat16_config({key: {"enabled": True}}).enabled is True
    assert isinstance(get_bfloat16_config({}), DeepSpeedBF16Config) and not get_bfloat16_config({}).enabled
    assert get_float16_config({"fp16": {"enabled": True, "initial_scale_power": 8}}).initial_dynamic_scale() == 256


def test_offload_config_enums_and_device_values():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum,
                                                       OffloadStateTypeEnum)

    assert [e.value for e in OffloadDeviceEnum] == ["none", "cpu", "nvme"] and OffloadDeviceEnum.cpu == "cpu"
    assert OffloadStateTypeEnum.optim_states == "optim_states" and len(OffloadStateTypeEnum) == 5
    cfg = DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu)
    assert cfg.device == OffloadDeviceEnum.cpu and type(cfg.device) is str    # reads back as a plain string
    assert DeepSpeedZeroOffloadParamConfig(device="none").device == OffloadDeviceEnum.none
    ds = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": OffloadDeviceEnum.cpu}}}, world_size=1)
    assert ds.zero_config.offload_param.device == "cpu"


def test_leaf_module_config_defaults():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
                                                           DEFAULT_LEAF_MODULE_NAMES, DeepSpeedZeroLeafModuleConfig)

    config = DeepSpeedZeroConfig()
    assert isinstance(config.leaf_module, DeepSpeedZeroLeafModuleConfig)
    assert config.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES and len(DEFAULT_LEAF_MODULE_CLASSES) == 3
    assert config.leaf_module.names == DEFAULT_LEAF_MODULE_NAMES == []
    assert config.leaf_module.name_suffixes == DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []
    DEFAULT_LEAF_MODULE_NAMES.append("x")   # the exported lists are copies: configs are not affected
    try:
        assert DeepSpeedZeroConfig().leaf_module.names == []
    finally:
        DEFAULT_LEAF_MODULE_NAMES.pop()
    assert DeepSpeedZeroConfig(leaf_module={"classes": "my.Class"}).leaf_module.classes == ["my.Class"]


def test_checkpoint_constants_name_our_layout(tmp_path):
    from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, constants as K
    from deepspeed.checkpoint.files import model_file, optim_file

    assert UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert optim_file(0, bf16=True) == K.BF16_ZERO_FILE_PREFIX + "0_mp_rank_00" + K.OPTIM_FILE_SUFFIX
    assert optim_file(1, bf16=False).startswith(K.ZERO_FILE_PREFIX)
    assert model_file().endswith(K.MODEL_FILE_SUFFIX)
    from deepspeed.runtime.checkpoint.loader import DEEPSPEED_KEYS
    assert {K.PARAM_SHAPES, K.BUFFER_NAMES, K.FROZEN_PARAM_SHAPES, K.DS_VERSION} <= DEEPSPEED_KEYS


def test_partition_functions():
    from deepspeed.runtime.utils import partition_balanced, partition_uniform, prefix_sum_inc

    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2] and partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_balanced([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0., 1.1, 1.9, 3., 3., 3.], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0., 1.1, 30, 3.], 3) == [0, 2, 3, 4]
    assert partition_balanced([1] * 5, 4) == [0, 2, 3, 4, 5]   # optimal and no stage left empty
    assert partition_balanced([1, 1], 4) == [0, 1, 2, 2, 2] and partition_balanced([], 2) == [0, 0, 0]
    weights = [52559872] + [12596224] * 24 + [0, 52559872]
    parts = partition_balanced(weights, 8)
    assert max(sum(weights[a:b]) for a, b in zip(parts, parts[1:])) == 52559872
    with pytest.raises(ValueError):
        partition_uniform(3, 0)


def test_runtime_utils_helpers(caplog):
    from deepspeed.runtime.utils import (PartitionedTensor, call_to_str, is_model_parallel_parameter, move_to_device,
                                         see_memory_usage)

    assert call_to_str("hello", 1138, val=3) == "hello(1138, val=3)" and call_to_str("int") == "int()"
    p = torch.nn.Parameter(torch.zeros(2))
    assert not is_model_parallel_parameter(p)
    p.tensor_model_parallel = True
    assert is_model_parallel_parameter(p)
    batch = move_to_device({"x": (torch.zeros(1), [torch.ones(1)])}, torch.device("meta"))
    assert batch["x"][0].device.type == "meta" and batch["x"][1][0].device.type == "meta"
    see_memory_usage("not logged")                 # no force: nothing (and no collective)
    see_memory_usage("forced", force=True)
    full = torch.arange(11.).view(11, 1)
    part = PartitionedTensor(full)                 # no process group: one part
    assert part.local_size() == (11,) and torch.equal(part.full(), full)
    again = PartitionedTensor.from_meta(part.to_meta(), part.local_data, None)
    assert torch.equal(again.full(), full)


def test_bf16_optimizer_matches_the_engine_optimizers_upstream_builds_it_for():
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    def build(**extra):
        cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)
        return engine.optimizer

    # no ZeRO: upstream accumulates bf16 gradients in bf16 by default and builds FP16_(Unfused)Optimizer;
    # only an explicit fp32 accumulation (which upstream refuses without ZeRO) is called BF16_Optimizer here
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    assert not isinstance(build(bf16={"enabled": True}), BF16_Optimizer)
    assert isinstance(build(bf16={"enabled": True}), FP16_UnfusedOptimizer)       # SGD: not fused
    assert isinstance(build(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}), BF16_Optimizer)
    assert not isinstance(build(fp16={"enabled": True}), BF16_Optimizer)
    assert not isinstance(build(), BF16_Optimizer)
    stage1 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    assert isinstance(build(**stage1, data_types={"grad_accum_dtype": "fp32"}), BF16_Optimizer)
    assert not isinstance(build(**stage1), BF16_Optimizer)                            # upstream: ZeRO optimizer
    with pytest.raises(TypeError, match="deepspeed.initialize"):
        BF16_Optimizer()


def test_fp16_optimizer_names_match_the_routes_upstream_takes():
    """fp16 without ZeRO: upstream builds FP16_Optimizer for FusedAdam, FP16_UnfusedOptimizer for
    others; checkpoint tests read their fp32 masters through `fp32_groups_flat` / `fp32_groups`."""
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def build(opt, **extra):
        cfg = {"train_batch_size": 1, "optimizer": {"type": opt, "params": {"lr": 0.1}}, **extra}
        model = torch.nn.Linear(2, 2)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        return engine.optimizer

    fused = build("Adam", fp16={"enabled": True})
    assert isinstance(fused, FP16_Optimizer) and not isinstance(fused, FP16_UnfusedOptimizer)
    flat = fused.fp32_groups_flat
    assert len(flat) == 1 and flat[0].dtype == torch.float32 and flat[0].numel() == 6
    unfused = build("SGD", fp16={"enabled": True})
    assert isinstance(unfused, FP16_UnfusedOptimizer) and not isinstance(unfused, FP16_Optimizer)
    assert [tuple(m.shape) for m in unfused.fp32_groups[0]] == [(2, 2), (2,)]
    zero = build("Adam", fp16={"enabled": True}, zero_optimization={"stage": 2})
    assert isinstance(zero, DeepSpeedZeroOptimizer) and not isinstance(zero, (FP16_Optimizer, FP16_UnfusedOptimizer))
    assert sum(t.numel() for t in zero.single_partition_of_fp32_groups) >= 6
    assert not isinstance(build("Adam"), (FP16_Optimizer, FP16_UnfusedOptimizer))
    with pytest.raises(TypeError, match="deepspeed.initialize"):
        FP16_Optimizer()


def test_on_device_builds_modules_on_meta_in_dtype():
    import deepspeed
    from deepspeed.utils import OnDevice

    assert deepspeed.OnDevice is OnDevice
    with OnDevice(dtype=torch.half, device="meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        index = torch.zeros(2, dtype=torch.long)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.half)}
    assert index.dtype == torch.long and index.device.type == "meta"   # only floating tensors are cast
    assert torch.empty(1).device.type == "cpu"                          # constructors restored
    with OnDevice(dtype=torch.half, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_parse_range_list():
    from deepspeed.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a", "1,"):
        with pytest.raises(ValueError):
            parse_range_list(bad)


def test_new_modules_keep_import_deepspeed_cheap():
    code = ("import sys, deepspeed, deepspeed.runtime.constants, deepspeed.utils.numa, deepspeed.checkpoint.constants;"
            "print([m for m in ('pydantic', 'deepspeed.runtime.engine') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_config_log_level_sets_the_deepspeed_logger():
    import logging

    import deepspeed
    from deepspeed.utils import logger, set_log_level_from_string

    saved = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        cfg = {"train_batch_size": 1, "log_level": "ERROR", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)
        assert engine.log_level() == "ERROR" and logger.getEffectiveLevel() == logging.ERROR
        logger.setLevel(logging.WARNING)
        del cfg["log_level"]
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)
        assert engine.log_level() is None and logger.getEffectiveLevel() == logging.WARNING   # left alone
        set_log_level_from_string("info")
        assert logger.level == logging.INFO
        with pytest.raises(ValueError):
            set_log_level_from_string("loud")
    finally:
        logger.setLevel(saved)


def test_version_attributes_upstream_checks():
    import deepspeed

    for name in ("__git_hash__", "__git_branch__", "__version__", "__version_major__", "__version_minor__",
                 "__version_patch__"):
        assert hasattr(deepspeed, name), name
    assert deepspeed.__git_hash__ == deepspeed.git_hash


def test_offload_with_a_client_optimizer_needs_a_deepspeed_cpu_optimizer():
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    def init(optimizer_cls, force):
        model = torch.nn.Linear(4, 4)
        cfg = {"train_batch_size": 1, "zero_force_ds_cpu_optimizer": force,
               "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
        return deepspeed.initialize(model=model, optimizer=optimizer_cls(model.parameters()), config=cfg)[0]

    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        init(torch.optim.Adam, True)
    assert init(torch.optim.Adam, False).zero_optimization_stage() == 1
    assert init(DeepSpeedCPUAdam, True).zero_optimization_stage() == 1


def test_partition_balanced_is_optimal_by_brute_force():
    # minimise the heaviest part, then maximise the lightest, over every split into non-empty parts
    import itertools
    import random

    from deepspeed.runtime.utils import partition_balanced

    def weights_of(w, bounds):
        return [sum(w[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 8), rng.randint(1, 4)
        w = [rng.randint(0, 5) for _ in range(n)]
        got = weights_of(w, partition_balanced(w, k))
        if n < k:
            continue
        best = min((max(s), -min(s)) for s in (weights_of(w, [0, *cuts, n])
                                               for cuts in itertools.combinations(range(1, n), k - 1)))
        assert (max(got), -min(got)) == best, (w, k, got)
    assert weights_of([1, 1, 1, 1, 0, 1], partition_balanced([1, 1, 1, 1, 0, 1], 4)) == [2, 1, 1, 1]


def test_moe_param_group_helpers_and_checkpoint_names():
    from deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))
    expert = model[1].weight
    expert.allreduce, expert.group_name = False, "ep_size_2"
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p",
                                                                   "lr": 0.1})
    assert [len(g["params"]) for g in groups] == [3, 1]
    assert groups[1]["params"][0] is expert and groups[1]["moe"] and groups[1]["name"] == "ep_size_2"
    assert groups[0]["lr"] == groups[1]["lr"] == 0.1 and is_moe_param(expert) and not is_moe_param(model[0].weight)
    plain = split_params_into_different_moe_groups_for_optimizer([{"params": list(model[0].parameters())}])
    assert len(plain) == 1 and len(plain[0]["params"]) == 2
    assert get_model_ckpt_name_for_rank("d/global_step0", "00") == "d/global_step0/mp_rank_00_model_states.pt"
    assert get_zero_ckpt_name_for_rank("d", 1, 0) == "d/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_zero3_linear_function_matches_linear_and_works_with_torch_func():
    """runtime.zero.linear: gradients equal F.linear's (batched, 3-D and unbatched, with and without
    bias), torch.func.grad and vmap go through it, and backward replays forward's autocast state."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, LinearModuleForZeroStage3, zero3_linear_wrap

    gen = torch.Generator().manual_seed(0)
    for shape in [(8, ), (3, 8), (2, 3, 8)]:
        for with_bias in (True, False):
            w = torch.randn(4, 8, generator=gen, requires_grad=True)
            x = torch.randn(*shape, generator=gen, requires_grad=True)
            b = torch.randn(4, generator=gen, requires_grad=True) if with_bias else None
            ours = [t for t in (x, w, b) if t is not None]
            ref = [t.detach().clone().requires_grad_() for t in ours]
            zero3_linear_wrap(x, w, b).pow(2).sum().backward()
            torch.nn.functional.linear(ref[0], ref[1], ref[2] if with_bias else None).pow(2).sum().backward()
            for a, r in zip(ours, ref):
                torch.testing.assert_close(a.grad, r.grad)
    w, b = torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)
    xs = torch.randn(3, 8, generator=gen)
    grads = torch.func.grad(lambda w_, x_: zero3_linear_wrap(x_, w_, None).sum(), argnums=(0, 1))(w, xs)
    torch.testing.assert_close(grads[0], torch.ones(3, 4).t() @ xs)
    mapped = torch.func.vmap(lambda xi: LinearFunctionForZeroStage3.apply(xi, w, b).sum())(xs)
    torch.testing.assert_close(mapped, (xs @ w.t() + b).sum(-1))
    x = xs.clone().requires_grad_()
    out = zero3_linear_wrap(x, w.requires_grad_(), None)
    assert out.grad_fn._fwd_used_autocast is False
    with torch.autocast("cpu", dtype=torch.bfloat16):   # backward keeps forward's (no) autocast
        out.sum().backward()
    assert x.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert LinearModuleForZeroStage3(8, 4)(xs).dtype == torch.bfloat16
    assert LinearModuleForZeroStage3(8, 4).half()(xs.half()).dtype == torch.float16


def test_checkpoint_engine_round_trip_and_the_aio_op(tmp_path):
    import deepspeed
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.runtime.checkpoint_engine import CheckpointEngine, TorchCheckpointEngine
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES

    engine = TorchCheckpointEngine()
    state = {"w": torch.arange(6.0).view(2, 3), "step": 3}
    engine.create("tag")
    engine.save(state, str(tmp_path / "x.pt"))
    assert engine.commit("tag") and not engine.is_decoupled()
    loaded = engine.load(str(tmp_path / "x.pt"), map_location="cpu")
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
    with pytest.raises(NotImplementedError):
        CheckpointEngine().save(state, str(tmp_path / "y.pt"))
    assert deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]   # the Python handle: tests gating on it run
    assert AsyncIOBuilder().is_compatible() and hasattr(AsyncIOBuilder().load(), "aio_handle")
    assert MIN_SWAPPABLE_BYTES == 1 << 20


def test_zero_init_refuses_a_one_rank_group_under_a_multi_process_launcher():
    """Upstream issue 8084: a size-1 group created before the launcher's world (a library calling
    init_process_group itself) made every rank keep the whole model, silently. Ours raises."""
    from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error as check

    message = check(dp_world_size=1, explicit_process_group=None, env={"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in message and "init_distributed" in message
    for env in ({"WORLD_SIZE": "1"}, {}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "x"}, {"WORLD_SIZE": None}):
        assert check(dp_world_size=1, explicit_process_group=None, env=env) is None
    assert check(dp_world_size=8, explicit_process_group=None, env={"WORLD_SIZE": "8"}) is None
    assert check(dp_world_size=1, explicit_process_group=object(), env={"WORLD_SIZE": "8"}) is None
    script = """
import os, torch, torch.distributed as dist
os.environ["WORLD_SIZE"] = "2"   # as a launcher's second process would see it
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import deepspeed
try:
    with deepspeed.zero.Init():
        torch.nn.Linear(4, 4)
    print("no error")
except RuntimeError as e:
    print("raised:", e)
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "raised: zero.Init: the launcher started WORLD_SIZE=2" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("in_splits,out_splits,in_f,out_f", [(1, 1, 32, 32), (2, 3, 23, 29), (5, 2, 29, 23)])
def test_tiled_linear_equals_its_linear_forward_and_backward(in_splits, out_splits, in_f, out_f):
    import copy

    from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

    torch.manual_seed(0)
    base = torch.nn.Linear(in_f, out_f)
    tiled = TiledLinear(in_f, out_f, init_linear=copy.deepcopy(base), in_splits=in_splits, out_splits=out_splits)
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in base.parameters())
    from deepspeed.runtime.zero.stage3 import plan_units
    assert len(plan_units(tiled).units) == in_splits * out_splits   # ZeRO-3 gathers one tile at a time
    x = torch.randn(3, in_f)
    torch.testing.assert_close(tiled(x), base(x))
    base(x).pow(2).sum().backward()
    tiled(x).pow(2).sum().backward()
    for r, row in enumerate(tiled.linears):
        rows = slice(tiled.out_parts[r], tiled.out_parts[r + 1])
        for c, tile in enumerate(row):
            torch.testing.assert_close(tile.weight.grad, base.weight.grad[rows, tiled.in_parts[c]:tiled.in_parts[c + 1]])
            assert (tile.bias is not None) == (c == in_splits - 1)
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, base.bias.grad[rows])

    class ReturnsBias(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), self.bias

    base_rb = ReturnsBias(in_f, out_f)
    tiled_rb = TiledLinearReturnBias(in_f, out_f, linear_cls=ReturnsBias, init_linear=copy.deepcopy(base_rb),
                                     in_splits=in_splits, out_splits=out_splits)
    (out, bias), (ref_out, ref_bias) = tiled_rb(x), base_rb(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(bias, ref_bias)
    for bad in (0, in_f + 1):
        with pytest.raises(RuntimeError, match="in_splits"):
            TiledLinear(in_f, out_f, in_splits=bad)
