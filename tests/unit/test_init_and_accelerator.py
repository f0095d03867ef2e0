"""init_distributed's rank discovery and the accelerator facade (no process group needed)."""

import os

import pytest
import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.comm.init import mpi_discovery


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables; and whatever the test's discovery writes into os.environ (RANK,
    WORLD_SIZE, MASTER_PORT, ...) is undone afterwards, so a later test in this process that
    initialises deepspeed.comm does not wait for 8 ranks."""
    saved = dict(os.environ)
    yield _clear_launcher_env(monkeypatch)
    os.environ.clear()
    os.environ.update(saved)


def _clear_launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_LAUNCH_NODE_IPADDR", "PMIX_RANK", "PMIX_SIZE",
                "MPI_LOCALRANKID"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_openmpi_discovery(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "3")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "8")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert mpi_discovery(distributed_port=29555, verbose=False)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "8", "1")
    assert os.environ["MASTER_PORT"] == "29555"


def test_slurm_discovery_uses_launch_node_address(clean_env):
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3")
    assert mpi_discovery(verbose=False)
    assert os.environ["MASTER_ADDR"] == "10.1.2.3" and os.environ["RANK"] == "1"


def test_no_launcher_variables_found(clean_env):
    assert not mpi_discovery(verbose=False)
    assert "RANK" not in os.environ


def test_cpu_accelerator_surface():
    accel = get_accelerator()
    if torch.cuda.is_available():
        pytest.skip("CPU facade only")
    assert accel.device_name() == "cpu" and accel.communication_backend_name() == "gloo"
    assert accel.device_name(0) == "cpu" and accel.device_count() >= 1   # as upstream: CPU tensors report "cpu"
    assert torch.zeros(1, device=accel.device_name(0)).device == torch.device(accel.device_name(0))
    state = accel.get_rng_state()
    a = torch.rand(3)
    accel.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert accel.memory_allocated() > 0 and accel.total_memory() > accel.available_memory() > 0
    assert accel.is_bf16_supported() and torch.bfloat16 in accel.supported_dtypes()
    # upstream's typed constructors (its aio tests: ByteTensor(list(bytes)))
    assert torch.equal(accel.ByteTensor(list(b"ab")), torch.tensor([97, 98], dtype=torch.uint8))
    assert accel.LongTensor([1]).dtype == torch.int64 and accel.DoubleTensor([1.0]).dtype == torch.float64


def test_initialize_without_model_is_an_assertion_error():
    """Upstream asserts here: code that catches AssertionError (its tests, wrappers) keeps working."""
    import deepspeed

    with pytest.raises(AssertionError, match="deepspeed.initialize requires a model") as info:
        deepspeed.initialize(model=None, config={"train_batch_size": 1})
    assert isinstance(info.value, ValueError)  # and still the ValueError it was before


def test_cpu_device_count_follows_local_size(clean_env):
    """Upstream's CPU accelerator counts the launcher's processes on this node (LOCAL_SIZE); its
    test harness skips every world size above device_count(). The CPU accelerator itself, also
    where CUDA is visible (get_accelerator() is then CUDA's)."""
    from deepspeed.accelerator.real_accelerator import CPU_Accelerator

    accel = CPU_Accelerator()
    clean_env.setenv("LOCAL_SIZE", "4")
    assert accel.device_count() == 4
    clean_env.delenv("LOCAL_SIZE")
    nodes = [p for p in __import__("glob").glob("/sys/devices/system/node/node[0-9]*/cpulist")
             if open(p).read().strip()]
    assert accel.device_count() == max(len(nodes), 1)


def test_zero_init_initialises_deepspeed_comm_in_a_single_process(tmp_path):
    # upstream: zero.Init sets up the process group like deepspeed.initialize does, even for one
    # process started without a launcher (own interpreter: the group lives for the process)
    import os
    import subprocess
    import sys

    script = ("import torch, deepspeed, deepspeed.comm as dist\n"
              "assert not dist.is_initialized()\n"
              "with deepspeed.zero.Init():\n"
              "    assert dist.is_initialized() and dist.get_world_size() == 1\n"
              "    layer = torch.nn.Linear(4, 4)\n"
              "assert layer.weight.ds_tensor.numel() == 16\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dist_init_required_false_without_a_group_raises():
    import torch.distributed as tdist

    import deepspeed

    if tdist.is_initialized():
        pytest.skip("a process group already exists in this interpreter")
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        deepspeed.init_distributed(dist_init_required=False)
    assert not tdist.is_initialized()


def test_accelerator_pin_memory_api_agrees_with_torch():
    import torch

    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    pinned = accel.pin_memory(torch.randn(4, 8))
    assert accel.is_pinned(pinned) == pinned.is_pinned()
    assert accel.unpin_memory(pinned) is None   # torch frees pinned memory with the tensor


def test_accelerator_classes_at_upstreams_module_paths() -> None:
    """Upstream keeps one accelerator class per module (its own test walks them and expects exactly
    one `*_Accelerator` name in each); code imports them from there."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    for module_name, class_name in (("cpu_accelerator", "CPU_Accelerator"), ("cuda_accelerator", "CUDA_Accelerator")):
        module = importlib.import_module(f"deepspeed.accelerator.{module_name}")
        assert [n for n in dir(module) if n.endswith("_Accelerator")] == [class_name]
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    expected = CUDA_Accelerator if get_accelerator().device_name() == "cuda" else CPU_Accelerator
    assert isinstance(get_accelerator(), expected)
