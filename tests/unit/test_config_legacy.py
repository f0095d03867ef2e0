"""The legacy deepspeed.config classes from the 0.3 manual."""

import doctest

import pytest

import deepspeed
import deepspeed.config as legacy
from deepspeed.config import BatchConfig, Config, FP16Config, TrainingConfig
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError


def test_manual_examples():
    c = Config(verbose=True)
    assert c.verbose is True and c["verbose"] is True
    assert Config.from_dict({"verbose": True}).verbose is True
    assert deepspeed.config.TrainingConfig is TrainingConfig


def test_module_docstring_examples_run():
    assert doctest.testmod(legacy, raise_on_error=True).attempted == 3


def test_item_access_and_struct_behaviour():
    c = Config(a=1)
    c["b"] = 2
    assert (c.b, "a" in c, "z" in c, c.to_dict()) == (2, True, False, {"a": 1, "b": 2})
    assert Config(a=1) == Config(a=1) and Config(a=1) != Config(a=2)
    with pytest.raises(KeyError):
        c["missing"]
    assert "a=1" in repr(c)


def test_training_config_builds_sub_configs_from_dicts():
    t = TrainingConfig.from_dict({"batch": {"train_batch_size": 8, "gradient_accumulation_steps": 2},
                                  "fp16": {"enabled": True, "clip": 1.0}})
    assert isinstance(t.batch, BatchConfig) and isinstance(t.fp16, FP16Config)
    assert t.batch.train_micro_batch_size_per_gpu is None and t.fp16.clip == 1.0
    assert TrainingConfig().batch is None and TrainingConfig().fp16 is None


def test_subclasses_reject_unknown_fields():
    with pytest.raises(DeepSpeedConfigError, match="BatchConfig: unknown field 'train_batch_sise' "
                                                   r"\(did you mean 'train_batch_size'\?\)"):
        BatchConfig(train_batch_sise=8)
    with pytest.raises(DeepSpeedConfigError, match="TrainingConfig: unknown field 'fp32'"):
        TrainingConfig(fp32={})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batch_resolve_uses_world_size_from_env(monkeypatch, world):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    b = BatchConfig(train_batch_size=8 * world, train_micro_batch_size_per_gpu=2)
    b.resolve()
    assert (b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps) == (8 * world, 2, 4)


def test_batch_resolve_defaults_to_world_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    b = BatchConfig(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3)
    b.resolve()
    assert b.train_batch_size == 12
    b2 = BatchConfig(train_batch_size=6)
    b2.resolve(world_size=3)
    assert (b2.train_micro_batch_size_per_gpu, b2.gradient_accumulation_steps) == (2, 1)


def test_batch_is_valid(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert BatchConfig(train_batch_size=8, train_micro_batch_size_per_gpu=2).is_valid()
    assert not BatchConfig(train_batch_size=7, train_micro_batch_size_per_gpu=2).is_valid()
    assert not BatchConfig(gradient_accumulation_steps=2).is_valid()
    assert not BatchConfig(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3).is_valid()
    with pytest.raises(DeepSpeedConfigError, match="is not divisible"):
        BatchConfig(train_batch_size=7, train_micro_batch_size_per_gpu=2).resolve()


def test_fp16_is_valid():
    assert FP16Config(enabled=True, clip=1.0).is_valid() and FP16Config().is_valid()
    assert not FP16Config(enabled="yes").is_valid()
    assert not FP16Config(clip=-1.0).is_valid()


def test_training_config_validity_covers_sub_configs(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    good = TrainingConfig(batch={"train_batch_size": 4}, fp16={"enabled": True})
    assert good.is_valid() and good.batch.gradient_accumulation_steps == 1
    assert not TrainingConfig(batch={"train_batch_size": 4}, fp16={"clip": -2}).is_valid()
    assert not TrainingConfig(batch={"gradient_accumulation_steps": 4}).is_valid()


def test_training_config_converts_to_a_json_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    t = TrainingConfig(batch={"train_batch_size": 8, "gradient_accumulation_steps": 2}, fp16={"enabled": True, "clip": 0.5})
    t.resolve()
    ds = t.to_ds_config()
    assert ds == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "fp16": {"enabled": True}, "gradient_clipping": 0.5}
    cfg = DeepSpeedConfig(ds, world_size=2)
    assert cfg.model.fp16.enabled and cfg.model.gradient_clipping == 0.5
