"""Names upstream DeepSpeed's own test harness (tests/unit/common.py, util.py) and tools import at
collection: without them every upstream test fails before it runs (see docs/compatibility.md)."""

import subprocess
import sys

import pytest


def test_harness_imports_resolve():
    code = """
import deepspeed
from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
from deepspeed.git_version_info import torch_info, compatible_ops, installed_ops, version
from deepspeed.utils.torch import required_torch_version
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder, OpBuilder
assert is_current_accelerator_supported()
assert version == deepspeed.__version__
assert set(torch_info) >= {"version", "cuda_version", "hip_version"}
assert required_torch_version(min_version="2.0") and not required_torch_version(max_version="1.0")
assert compatible_ops[CPUAdamBuilder.NAME] and compatible_ops[FusedAdamBuilder.NAME]
assert not compatible_ops[InferenceBuilder.NAME] and not any(installed_ops.values())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_builders_never_compile_and_say_where_the_equivalent_is():
    from deepspeed.ops.op_builder import CPUAdamBuilder, InferenceBuilder

    with pytest.raises(RuntimeError, match=r"deepspeed.ops.adam \(DeepSpeedCPUAdam\)"):
        CPUAdamBuilder().load()
    with pytest.raises(RuntimeError, match="no equivalent"):
        InferenceBuilder().load()
    assert CPUAdamBuilder().absolute_name() == "deepspeed.ops.cpu_adam_op"


def test_required_torch_version_needs_a_bound():
    from deepspeed.utils.torch import required_torch_version

    with pytest.raises(AssertionError, match="min_version or max_version"):
        required_torch_version()


def test_layer_specs_build_and_pipeline_module_subclasses():
    import torch

    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layer = LayerSpec(torch.nn.Linear, 4, 8, bias=False).build()
    assert isinstance(layer, torch.nn.Linear) and layer.weight.shape == (8, 4) and layer.bias is None
    assert repr(LayerSpec(torch.nn.Linear, 4, 8)) == "Linear(4, 8)"
    tied = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4)
    assert tied.key == "embed" and tied.tied_weight_attr == ["weight"]
    with pytest.raises(RuntimeError, match="torch.nn.Module types"):
        LayerSpec(len)

    class Pipe(PipelineModule):  # defining a subclass works, as upstream's test models do
        pass

    assert issubclass(Pipe, torch.nn.Module)
    # building one needs a process group (tests/unit/test_pipe_module.py, tests/distributed/test_pipeline.py)
    from deepspeed import comm as ds_comm

    if not ds_comm.is_initialized():
        with pytest.raises(RuntimeError, match="init_distributed"):
            Pipe(layers=[LayerSpec(torch.nn.Linear, 4, 4)], num_stages=2)


def test_moe_layer_imports_and_builds():
    # upstream's tests/unit/simple_model.py imports it at module level and subclasses it
    import torch

    import deepspeed
    from deepspeed.moe.layer import MoE

    assert deepspeed.moe.layer.MoE is MoE

    class Experts(MoE):
        pass

    layer = Experts(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2)
    assert layer.expert_group_name == "ep_size_1" and layer.num_local_experts == 2


def test_sharded_moe_dist_is_deepspeed_comm_and_patches_reach_the_gating(monkeypatch):
    # upstream's test_moe.py patches sharded_moe.dist.all_reduce / get_world_size to count the no-drop capacity
    # all-reduce of top1/top2/topkgating; the patch must reach the call the gating makes
    import torch

    import deepspeed.comm
    import deepspeed.moe.sharded_moe as sharded_moe

    assert sharded_moe.dist is deepspeed.comm
    calls = []
    monkeypatch.setattr(sharded_moe.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sharded_moe.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", lambda t, op=None, group=None: calls.append((op, group)))
    group = object()
    sharded_moe.top2gating(torch.randn(8, 4), 1, 0, drop_tokens=False, ep_group=group, top2_2nd_expert_sampling=False)
    assert calls == [(deepspeed.comm.ReduceOp.MAX, group)]
