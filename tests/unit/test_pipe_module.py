"""PipelineModule's pure parts (partitioning, specs) and its errors; a one-rank process group
for the module itself (the distributed behaviour is in tests/distributed/test_pipeline.py)."""

import pytest
import torch
from torch import nn

from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.module import count_layer_params, partition_layers


class Big(nn.Linear):
    pass


def test_count_params_builds_on_meta_only():
    built = []

    class Tracked(nn.Linear):
        def __init__(self, *a):
            super().__init__(*a)
            built.append(self.weight.device.type)

    counts = count_layer_params([LayerSpec(Tracked, 1000, 1000), lambda x: x, nn.Linear(2, 3)])
    assert counts == [1000 * 1000 + 1000, 0, 9]
    assert built == ["meta"]   # a large layer is never materialised to count it


def test_partition_methods():
    specs = [LayerSpec(nn.Linear, 4, 4)] * 2 + [LayerSpec(Big, 64, 64)] + [LayerSpec(nn.Linear, 4, 4)] * 3
    assert partition_layers(specs, 2, "uniform") == [0, 3, 6]
    assert partition_layers(specs, 2, "parameters") == [0, 3, 6]    # the big layer on stage 0 alone is heavier
    by_params = partition_layers(specs, 3, "parameters")
    assert by_params[1:3] == [2, 3]                                   # the big layer gets a stage of its own
    from deepspeed.runtime.utils import partition_balanced

    # type:<regex> weighs matching layer types 1, others 0 (case-insensitive, as upstream)
    assert partition_layers(specs, 2, "type:^linear$") == partition_balanced([1, 1, 0, 1, 1, 1], 2)
    assert partition_layers(specs, 3, "type:BIG|^linear$") == partition_balanced([1] * 6, 3) == [0, 2, 4, 6]
    assert partition_layers(specs, 2, [0, 1, 6]) == [0, 1, 6]
    with pytest.raises(RuntimeError, match="found no valid layers"):
        partition_layers(specs, 2, "type:Conv")
    with pytest.raises(ValueError, match="explicit boundaries"):
        partition_layers(specs, 2, [0, 7, 6])
    with pytest.raises(NotImplementedError, match="profile"):
        partition_layers(specs, 2, "profile")


def test_specs():
    spec = LayerSpec(nn.Linear, 3, 4, bias=False)
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.bias is None and repr(spec) == "Linear(3, 4, bias=False)"
    tied = TiedLayerSpec("embed", nn.Embedding, 5, 2, tied_weight_attr="weight")
    assert tied.key == "embed" and tied.tied_weight_attr == ["weight"]
    with pytest.raises(RuntimeError, match="torch.nn.Module types"):
        LayerSpec(len)


def test_module_single_process(monkeypatch):
    """One rank, one stage: the module runs its layers, names them by global index, and the
    engine refuses ZeRO-3 and the per-call API."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.errors import NotSupportedYet
    from deepspeed.runtime.pipe.engine import PipelineError

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29611")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    layers = [LayerSpec(nn.Linear, 4, 8), torch.tanh, LayerSpec(nn.Linear, 8, 2)]
    model = PipelineModule(layers, num_stages=1, loss_fn=nn.functional.mse_loss)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = torch.randn(3, 4)
    want = model.forward_funcs[2](torch.tanh(model.forward_funcs[0](x)))
    torch.testing.assert_close(model(x), want)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(NotSupportedYet, match="stage=3"):
        deepspeed.initialize(model=model, config={**cfg, "zero_optimization": {"stage": 3}})
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    with pytest.raises(PipelineError, match="train_batch"):
        engine(x)
    data = iter([(torch.randn(2, 4), torch.randn(2, 2)) for _ in range(3)])
    before = engine.module.forward_funcs[0].weight.detach().clone()
    loss = engine.train_batch(data)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert not torch.equal(before, engine.module.forward_funcs[0].weight)
    engine.destroy()
    with pytest.raises(RuntimeError, match="num_stages"):
        PipelineModule(layers)
    with pytest.raises(RuntimeError, match="must divide"):
        PipelineModule(layers, num_stages=2)
