"""The DeepSpeed surface Hugging Face transformers 5.23 / accelerate 1.15 use (HF_SURFACE.md,
Tiers 0-3 and the Tier 4 rows we implement): module paths, attribute chains reachable after a
bare `import deepspeed` (upstream imports eagerly; we resolve lazily, PEP 562), and the module
globals transformers patches around zero.Init. No transformers needed: these are our names."""

from __future__ import annotations

import importlib
import inspect
import os

import pytest
import torch

from chains import resolve_after_bare_import

MODULES = [
    "deepspeed.comm", "deepspeed.runtime.lr_schedules", "deepspeed.runtime.engine", "deepspeed.runtime.zero",
    "deepspeed.runtime.zero.partition_parameters", "deepspeed.zero", "deepspeed.checkpoint.utils",
    "deepspeed.launcher.runner", "deepspeed.ops.adam", "deepspeed.ops.adagrad", "deepspeed.ops.lion",
    "deepspeed.utils", "deepspeed.utils.zero_to_fp32", "deepspeed.accelerator",
]

# Attribute chains, each evaluated in a fresh interpreter after only `import deepspeed`.
CHAINS = [
    "deepspeed.initialize", "deepspeed.DeepSpeedEngine", "deepspeed.comm", "deepspeed.zero", "deepspeed.runtime",
    "deepspeed.utils", "deepspeed.accelerator", "deepspeed.checkpoint", "deepspeed.ops", "deepspeed.launcher",
    "deepspeed.tp_model_init", "deepspeed.__version__",
    "deepspeed.comm.is_initialized", "deepspeed.comm.init_distributed", "deepspeed.comm.get_rank",
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES", "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.runtime.zero.GatheredParameters",
    "deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor",
    "deepspeed.runtime.zero.partition_parameters._orig_torch_arange",
    "deepspeed.runtime.zero.partition_parameters.get_accelerator",
    "deepspeed.zero.Init", "deepspeed.zero.GatheredParameters", "deepspeed.zero.register_external_parameter",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
    "deepspeed.ops.adam.DeepSpeedCPUAdam", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
    "deepspeed.ops.lion.DeepSpeedCPULion",
    "deepspeed.utils.logger", "deepspeed.utils.is_initialized", "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.accelerator.get_accelerator",
]

def test_attribute_chains_resolve_after_bare_import() -> None:
    result = resolve_after_bare_import(CHAINS)
    assert result["bad"] == {}
    assert result["eager"] == []          # resolved on first use, not by `import deepspeed`
    assert result["zero_alias"] is True


@pytest.mark.parametrize("name", MODULES)
def test_module_paths_import(name: str) -> None:
    importlib.import_module(name)


def test_unknown_attribute_is_attribute_error() -> None:
    import deepspeed

    for obj in (deepspeed, deepspeed.runtime, deepspeed.utils, deepspeed.zero, deepspeed.ops):
        with pytest.raises(AttributeError):
            obj.no_such_thing_here
        assert not hasattr(obj, "__wrapped__")


def test_valid_lr_schedules_names_classes() -> None:
    from deepspeed.runtime import lr_schedules

    assert {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"} <= set(
        lr_schedules.VALID_LR_SCHEDULES)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = lr_schedules.WarmupLR(opt, warmup_num_steps=2)
    assert type(sched).__name__ in lr_schedules.VALID_LR_SCHEDULES


def test_engine_signatures_hf_introspects() -> None:
    from deepspeed import DeepSpeedEngine

    assert "exclude_frozen_parameters" in inspect.signature(DeepSpeedEngine.save_checkpoint).parameters
    assert "scale_wrt_gas" in inspect.signature(DeepSpeedEngine.backward).parameters
    for name in ("set_gradient_accumulation_boundary", "get_global_grad_norm", "zero_gather_16bit_weights_on_model_save",
                 "_zero3_consolidated_16bit_state_dict", "_consolidated_16bit_state_dict", "load_checkpoint", "destroy", "compile"):
        assert callable(getattr(DeepSpeedEngine, name)), name
    assert issubclass(DeepSpeedEngine, torch.nn.Module)


def test_clone_tensors_for_torch_save() -> None:
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(6.0)
    item = {"a": flat[:2], "b": [flat[2:4], (flat[4:], 3)], "c": "x"}
    out = clone_tensors_for_torch_save(item)
    assert torch.equal(out["a"], flat[:2]) and out["b"][1][1] == 3 and out["c"] == "x"
    assert isinstance(out["b"], list) and isinstance(out["b"][1], tuple)
    assert out["a"].untyped_storage().nbytes() == 2 * 4          # not the shared flat storage
    out["a"].add_(1)
    assert flat[0] == 0


def test_init_looks_up_patched_constructor_wrapper_at_entry() -> None:
    """transformers' prevent_arange_dtype_change: replaces the module global before entering
    zero.Init, recognises arange by identity and reads `target_device=`."""
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp

    seen = []
    original = pp.zero_wrapper_for_fp_tensor_constructor

    def wrapper_without_arange(fn, *args, **kwargs):
        if fn is pp._orig_torch_arange:
            seen.append(kwargs["target_device"])

            def keep_dtype(*a, **kw):
                kw.setdefault("device", kwargs["target_device"])
                return fn(*a, **kw)
            return keep_dtype
        return original(fn, *args, **kwargs)

    cfg = {"train_batch_size": "auto", "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}   # "auto" left in: HF calls Init early
    pp.zero_wrapper_for_fp_tensor_constructor = wrapper_without_arange
    try:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            layer = torch.nn.Linear(4, 3)
            ramp = torch.arange(3.0)
            zeros = torch.zeros(2)
    finally:
        pp.zero_wrapper_for_fp_tensor_constructor = original
    assert seen == [torch.device("cpu")]
    assert ramp.dtype == torch.float32 and zeros.dtype == torch.float32   # parameters are cast at partition
    assert torch.arange is pp._orig_torch_arange and torch.zeros(1).dtype == torch.float32   # restored
    w = layer.weight
    assert (w.ds_numel, tuple(w.ds_shape), w.dtype) == (12, (4, 3)[::-1], torch.bfloat16)
    assert w.ds_tensor.numel() == 12 and hasattr(w, "ds_id") and hasattr(w, "ds_status")
    with deepspeed.zero.GatheredParameters([w, None, layer.bias], modifier_rank=0):
        assert w.shape == (3, 4)
        w.data.fill_(2.0)
    with deepspeed.zero.GatheredParameters(w):
        assert torch.all(w == 2.0)
    assert w.numel() == 0


def test_launcher_environment_file_name() -> None:
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME

    assert DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env")
