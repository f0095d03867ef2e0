"""torch_autocast helpers: the safe-module list, which params are marked, comm dtypes, errors."""

import pytest
import torch
from torch import nn

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import torch_autocast as ta
from deepspeed.runtime.torch_autocast import (AUTOCAST_PARAMS, PARAM_COMM_DTYPE_ATTR_NAME, autocast_if_enabled,
                                              get_all_comm_dtypes, get_autocast_dtype, get_comm_dtype,
                                              get_default_autocast_lower_precision_modules, has_autocast_dtype,
                                              has_comm_dtype, init_autocast_params, is_autocast_initialized,
                                              sort_dtypes)


@pytest.fixture(autouse=True)
def fresh_registry():
    AUTOCAST_PARAMS.reset()
    yield
    AUTOCAST_PARAMS.reset()


class MyLinear(nn.Linear):
    """A subclass: upstream matches exact classes, so this is not lower precision safe by default."""


class Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv1d(2, 2, 3)
        self.sub = MyLinear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Embedding(3, 4))


def test_default_module_list_is_upstreams_form():
    names = get_default_autocast_lower_precision_modules()
    assert names == ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                     "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]
    assert ta.resolve_module_classes(names) == [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d]
    assert ta.resolve_module_classes(["torch.nn.Linear"]) == [nn.Linear]


def test_init_marks_exactly_the_safe_modules_params():
    net = Net()
    assert not is_autocast_initialized()
    init_autocast_params(net, torch.bfloat16, None)
    assert is_autocast_initialized() and get_autocast_dtype() == torch.bfloat16
    safe = [net.fc.weight, net.fc.bias, net.conv.weight, net.conv.bias, net.blocks[0].weight]
    unsafe = [net.norm.weight, net.norm.bias, net.sub.weight, net.sub.bias, net.blocks[1].weight]
    for p in safe:
        assert has_comm_dtype(p) and has_autocast_dtype(p) and get_comm_dtype(p) == torch.bfloat16
        assert get_autocast_dtype(p) == torch.bfloat16
        assert getattr(p, PARAM_COMM_DTYPE_ATTR_NAME) == torch.bfloat16  # published for upstream probes
    for p in unsafe:
        assert not has_comm_dtype(p) and get_comm_dtype(p) == torch.float32 and get_autocast_dtype(p) is None
        assert not hasattr(p, PARAM_COMM_DTYPE_ATTR_NAME)
    assert get_all_comm_dtypes(net.parameters()) == {torch.bfloat16, torch.float32}
    assert sort_dtypes([torch.float32, torch.bfloat16, torch.float16]) == [torch.bfloat16, torch.float16,
                                                                           torch.float32]


def test_unmarked_param_reports_its_own_dtype():
    init_autocast_params(nn.Linear(2, 2), torch.float16, None)
    half = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    assert get_comm_dtype(half) == torch.float16


def test_configured_module_names_replace_the_default():
    net = Net()
    init_autocast_params(net, torch.float16, ["torch.nn.LayerNorm", f"{__name__}.MyLinear"])
    assert get_comm_dtype(net.norm.weight) == torch.float16 and get_comm_dtype(net.sub.weight) == torch.float16
    assert get_comm_dtype(net.fc.weight) == torch.float32


def test_engine_like_object_and_quantized_weights():

    class Engine:  # not an nn.Module: its .module is the model
        module = Net()

        def zero_quantized_weights(self):
            return False

    engine = Engine()
    init_autocast_params(engine, torch.bfloat16, None)
    assert has_comm_dtype(engine.module.fc.weight)
    engine.zero_quantized_weights = lambda: True
    with pytest.raises(ValueError, match="zero_quantized_weights"):
        init_autocast_params(engine, torch.bfloat16, None)


def test_dtype_none_means_torch_autocast_default():
    net = Net()
    init_autocast_params(net, None, None)
    assert get_comm_dtype(net.fc.weight) == torch.get_autocast_dtype(get_accelerator().device_name())


@pytest.mark.parametrize("name", ["torch.nn.NoSuchLayer", "no_such_package.Layer", "Linear",
                                  "torch.nn.functional.linear"])
def test_bad_class_name_names_the_config_key_and_value(name):
    with pytest.raises(ValueError) as info:
        init_autocast_params(Net(), torch.bfloat16, [name])
    assert "torch_autocast.lower_precision_safe_modules" in str(info.value) and repr(name) in str(info.value)
    assert not is_autocast_initialized()


def test_registry_holds_no_strong_reference():
    import gc
    import weakref

    layer = nn.Linear(2, 2)
    init_autocast_params(layer, torch.bfloat16, None)
    ref = weakref.ref(layer.weight)
    del layer
    gc.collect()
    assert ref() is None


class FakeEngine:

    def __init__(self, enabled, dtype=torch.bfloat16):
        self.enabled, self.dtype = enabled, dtype

    def torch_autocast_enabled(self):
        return self.enabled

    def torch_autocast_dtype(self):
        return self.dtype


def test_autocast_if_enabled_follows_the_engine():
    dev = get_accelerator().device_name()   # the engine autocasts on its accelerator (CUDA where visible)
    a, b = torch.ones(2, 2, device=dev), torch.ones(2, 2, device=dev)
    with autocast_if_enabled(FakeEngine(True)):
        assert (a @ b).dtype == torch.bfloat16
    with autocast_if_enabled(FakeEngine(False)):
        assert (a @ b).dtype == torch.float32
    with torch.autocast(dev, dtype=torch.bfloat16), autocast_if_enabled(FakeEngine(False)):
        assert (a @ b).dtype == torch.float32  # the engine's config wins over an outer autocast
