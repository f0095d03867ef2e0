"""The DeepSpeed surface TRL 1.16.0, OpenRLHF and LLaMA-Factory reach (docs/client_surface.md): every
module-level name of the survey resolves after a bare `import deepspeed`, and the engine-level chains
resolve and behave on real engines (gloo ranks), called the way those clients call them. The TRL
generation flow (remove hooks, generate, `_register_deepspeed_module`, train on) is compared with plain
PyTorch in tests/distributed/test_zero3_generation.py. No client package needed: these are our names."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "distributed"))
from harness import run_distributed  # noqa: E402

from chains import resolve_after_bare_import

# Attribute chains, each evaluated in a fresh interpreter after only `import deepspeed`.
CHAINS = [
    "deepspeed.version", "deepspeed.__version__", "deepspeed.init_distributed", "deepspeed.initialize",
    "deepspeed.DeepSpeedEngine", "deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.comm.get_rank",
    "deepspeed.zero.GatheredParameters", "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save", "deepspeed.accelerator.get_accelerator",
    "deepspeed.profiling.flops_profiler.get_model_profile", "deepspeed.tp_model_init",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum.cpu",
    *(f"deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum.{kind}"
      for kind in ("optim_states", "contiguous_grad_buffer", "hp_params", "lp_grads", "lp_params")),
]

def test_module_level_names_resolve_after_bare_import() -> None:
    import deepspeed

    assert resolve_after_bare_import(CHAINS)["bad"] == {}
    assert deepspeed.version == deepspeed.__version__      # OpenRLHF compares `deepspeed.version`


def test_tp_model_init_surface() -> None:
    """AutoTP: OpenRLHF calls tp_model_init (then module_inject's GatherReplacedLayerParams) only for
    tensor_parallel_size > 1; tp_size 1 returns the model itself, a bad size names the argument."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams  # noqa: F401 (OpenRLHF's import)

    layer = torch.nn.Linear(2, 2)
    assert deepspeed.tp_model_init(model=layer, tp_size=1, dtype=torch.float32) is layer
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        deepspeed.tp_model_init(model=layer, tp_size=0)
    with pytest.raises(ValueError, match="autotp_size is 4"):
        deepspeed.tp_model_init(model=layer, tp_size=2, config={"tensor_parallel": {"autotp_size": 4}})


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.v_head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.v_head(torch.relu(self.body(x)))


def _openrlhf_config(world: int) -> dict:
    """openrlhf/utils/deepspeed/deepspeed_utils.py get_train_ds_config(offload=False, adam_offload=False,
    stage=3, zpg=1), plus the optimizer section and batch sizes its strategy adds."""
    zero = {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none", "pin_memory": True},
            "sub_group_size": "auto", "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto", "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
            "zero_quantized_gradients": False, "reduce_scatter": True}
    return {"steps_per_print": 100, "zero_optimization": zero, "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "data_types": {"grad_accum_dtype": None}, "checkpoint": {"load_universal": False},
            "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world}


def openrlhf_engine_calls(save_dir: str) -> dict:
    """OpenRLHF's DeepspeedStrategy at ZeRO-3: initialize, train, offload/reload between phases,
    EMA through GatheredParameters(enabled=...), 16-bit save, checkpoint round trip."""
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    world = tdist.get_world_size()
    model = _Net()
    deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.Linear])   # as openrlhf/models/utils.py
    config = _openrlhf_config(world)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0   # partitioned between steps
    engine, optim, _, sched = deepspeed.initialize(
        model=model, optimizer=None, model_parameters=[p for p in model.parameters() if p.requires_grad],
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0), config=config,
        args={"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}, dist_init_required=True)
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and optim is engine.optimizer
    assert engine.zero_optimization_stage() == 3
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(tdist.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert engine.get_global_grad_norm() > 0 and sched.get_last_lr() == [1e-3]
    w = engine.module.body.weight
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE and w.numel() == 0 and tuple(w.ds_shape) == (8, 8)
    assert hasattr(w, "ds_id") and w.ds_numel == 64

    # offload_deepspeed_states / reload_deepspeed_states
    kinds = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
             OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]
    engine.optimizer.offload_states(include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()
    engine.reload_states(non_blocking=True)
    with torch.no_grad():
        before = engine(x)

    # moving_average: _z3_params_to_fetch + GatheredParameters(enabled=len(...) > 0)
    ema = _Net()
    for p in ema.parameters():
        fetch = [q for q in (p,) if hasattr(q, "ds_id") and q.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0):
            p.data.copy_(0.5 * p.data)
    trained = []
    for p in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=True):
            trained.append(p.data.clone())
    assert all(p.numel() == 0 for p in engine.module.parameters())

    # save_model at stage 3: the engine's 16-bit consolidation (rank 0 holds it)
    state = engine._consolidated_16bit_state_dict()
    if tdist.get_rank() == 0:
        assert list(state) == ["body.weight", "body.bias", "v_head.weight", "v_head.bias"]
        assert all(torch.equal(state[k], t) for k, t in zip(state, trained))
    engine.save_checkpoint(save_dir, tag="global_step1", client_state={"consumed_samples": 2}, save_latest=True)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    load_path, states = engine.load_checkpoint(save_dir, "global_step1", load_module_strict=True,
                                               load_optimizer_states=True, load_lr_scheduler_states=True,
                                               load_module_only=False)
    assert load_path is not None and states["consumed_samples"] == 2
    with torch.no_grad():
        return {"restored": torch.equal(engine(x), before)}


def test_openrlhf_strategy_calls_at_zero3() -> None:
    with tempfile.TemporaryDirectory() as save_dir:
        assert run_distributed(2, openrlhf_engine_calls, save_dir) == [{"restored": True}] * 2


def gathered_patterns() -> list:
    """GatheredParameters as the clients use it at ZeRO-3, on 2 ranks."""
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    rank = tdist.get_rank()
    config = _openrlhf_config(tdist.get_world_size())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    head = engine.module.v_head
    # LLaMA-Factory replace_model: `.data` rebound inside a modifier_rank=0 block; rank 0's value wins
    with deepspeed.zero.GatheredParameters([head.weight, head.bias], modifier_rank=0):
        head.weight.data = torch.full((1, 8), float(rank + 1))
        head.bias.data = torch.full((1,), float(rank + 1))
    # TRL SyncRefModelCallback: modifier_rank=0 over two models, written on rank 0 only
    ref, *_ = deepspeed.initialize(model=_Net(), config={k: v for k, v in config.items() if k != "optimizer"})
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()) + list(ref.module.parameters()),
                                           modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            for t, c in zip(ref.module.parameters(), engine.module.parameters()):
                t.data.mul_(0.0).add_(c.data, alpha=1.0)
    # TRL gather_if_zero3: only what is not AVAILABLE, de-duplicated; a generator (model.parameters())
    to_gather = {id(p): p for p in (head.weight, head.weight, None) if p is not None
                 and p.ds_status != ZeroParamStatus.AVAILABLE}
    with deepspeed.zero.GatheredParameters(list(to_gather.values())):
        with deepspeed.zero.GatheredParameters(engine.parameters()):
            seen = [head.weight.clone(), head.bias.clone()]
        assert head.weight.shape == (1, 8)
    with deepspeed.zero.GatheredParameters(ref.module.v_head.parameters()):
        copied = [p.clone() for p in ref.module.v_head.parameters()]
    # LLaMA-Factory count_parameters: numel 0 -> ds_numel
    counted = sum(p.numel() or p.ds_numel for p in engine.module.parameters())
    return [t.tolist() for t in seen] + [torch.equal(a, b) for a, b in zip(seen, copied)] + [counted]


def test_gathered_parameters_client_patterns() -> None:
    out = run_distributed(2, gathered_patterns)
    assert out[0] == out[1] == [[[1.0] * 8], [1.0], True, True, 8 * 8 + 8 + 8 + 1]


def trl_reference_model() -> tuple:
    """TRL prepare_deepspeed at ZeRO-3: no optimizer, training blocks popped, hidden-size keys added
    as dotted top-level keys (ignored, as upstream does), then model.eval() and forward."""
    import deepspeed
    import torch.distributed as tdist

    config = _openrlhf_config(tdist.get_world_size())
    config.pop("optimizer", None)
    config["zero_optimization"].pop("offload_optimizer", None)
    config.update({"zero_optimization.reduce_bucket_size": 64, "zero_optimization.stage3_param_persistence_threshold": 80,
                   "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64})
    ref, *_ = deepspeed.initialize(model=_Net(), config=config)
    ref.eval()
    with torch.no_grad():
        out = ref(torch.ones(2, 8))
    return tuple(out.shape), ref.zero_optimization_stage()


def test_trl_reference_model_at_zero3() -> None:
    assert run_distributed(2, trl_reference_model) == [((2, 1), 3)] * 2


def offload_view_names() -> dict:
    """`engine.optimizer.parameter_offload` as TRL's remove_hooks/add_hooks read it; the behaviour
    (generate, re-register, train on) is tests/distributed/test_zero3_generation.py."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=_Net(), config=_openrlhf_config(2))
    offload = engine.optimizer.parameter_offload
    hooks = len(offload.forward_hooks)
    offload._register_deepspeed_module(offload.module)        # again: replaces, adds none
    try:
        offload._register_deepspeed_module(offload.module.body)
        wrong_module = None
    except ValueError as e:
        wrong_module = str(e)
    coordinator = offload.param_coordinator
    coordinator._invalidate_trace()
    return {"module": offload.module is engine.module, "hooks": hooks > 0 and len(offload.forward_hooks) == hooks,
            "backward_hooks": offload.backward_hooks, "external": list(offload.module.ds_external_parameters()),
            "active": [p.ds_active_sub_modules for p in offload.module.parameters()][:1],
            "invalid": coordinator.is_invalid_trace(), "wrong_module": wrong_module}


def test_parameter_offload_names() -> None:
    out = run_distributed(2, offload_view_names)[0]
    assert {k: v for k, v in out.items() if k != "wrong_module"} == {
        "module": True, "hooks": True, "backward_hooks": [], "external": [], "active": [set()], "invalid": True}
    assert "not the engine's model" in out["wrong_module"] and "Linear" in out["wrong_module"]
