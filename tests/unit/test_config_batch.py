"""The pure batch-size solver and how DeepSpeedConfig picks the data-parallel world size."""

import pytest
import torch

from deepspeed.runtime.config import BatchSizes, DeepSpeedConfig, DeepSpeedConfigError, resolve_batch

# (train, micro, gas, world) -> expected (train, micro, gas); DeepSpeed 0.19.8's rules.
SOLVED = [
    ((32, 4, 2, 4), (32, 4, 2)),      # all three, consistent
    ((32, 4, None, 2), (32, 4, 4)),   # train + micro -> gas
    ((32, None, 2, 4), (32, 4, 2)),   # train + gas -> micro
    ((None, 4, 2, 4), (32, 4, 2)),    # micro + gas -> train
    ((16, None, None, 4), (16, 4, 1)),  # train only -> gas 1, micro = train / world
    ((None, 3, None, 2), (6, 3, 1)),  # micro only -> gas 1, train = micro * world
    ((8, None, None, 1), (8, 8, 1)),
    ((8, 8, None, 1), (8, 8, 1)),
    ((64, 2, None, 4), (64, 2, 8)),
]


@pytest.mark.parametrize("given,expected", SOLVED)
def test_solver_fills_the_missing_members(given, expected):
    assert resolve_batch(*given) == BatchSizes(*expected)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_solver_every_pair_over_world_sizes(world):
    micro, gas = 2, 3
    train = micro * gas * world
    for args in [(train, micro, None), (train, None, gas), (None, micro, gas), (train, micro, gas)]:
        assert resolve_batch(*args, world) == BatchSizes(train, micro, gas)


ERRORS = [
    ((32, 4, 2, 2), "train_batch_size (32) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2)"
                    " * data-parallel world size (2) = 16"),
    ((30, 4, None, 2), "train_batch_size (30) is not divisible by train_micro_batch_size_per_gpu (4) * "
                       "data-parallel world size (2) = 8"),
    ((30, None, 4, 2), "train_batch_size (30) is not divisible by gradient_accumulation_steps (4) * "
                       "data-parallel world size (2) = 8"),
    ((2, 4, None, 1), "train_batch_size (2) is not divisible by train_micro_batch_size_per_gpu (4)"),
    ((6, None, None, 4), "train_batch_size (6) is not divisible by data-parallel world size (4)"),
    ((8, 4, 0, 1), "gradient_accumulation_steps must be >= 1, got 0"),
    ((0, None, None, 1), "train_batch_size must be >= 1, got 0"),
    ((None, -2, None, 1), "train_micro_batch_size_per_gpu must be >= 1, got -2"),
    ((None, None, 4, 1), "either train_batch_size or train_micro_batch_size_per_gpu must be given "
                         "(only gradient_accumulation_steps = 4 was given)"),
    ((None, None, None, 1), "either train_batch_size or train_micro_batch_size_per_gpu must be given"),
    ((8, None, None, 0), "data-parallel world size must be an integer >= 1, got 0"),
    ((8.5, None, None, 1), "train_batch_size must be an integer, got 8.5"),
]


@pytest.mark.parametrize("args,message", ERRORS)
def test_solver_errors_show_the_arithmetic(args, message):
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_batch(*args)
    assert message in str(info.value)


def test_solver_reports_every_bad_value_at_once():
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_batch(0, -1, 0, 1)
    assert len(info.value.errors) == 3


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        resolve_batch(None, None, None, 1)


class FakeMpu:
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def test_world_size_argument_wins(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DeepSpeedConfig({"train_batch_size": 8}, mpu=FakeMpu(4), world_size=2)
    assert (cfg.world_size, cfg.train_micro_batch_size_per_gpu) == (2, 4)


def test_world_size_from_mpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, mpu=FakeMpu(4))
    assert (cfg.world_size, cfg.train_batch_size) == (4, 24)


class FakeMesh:
    """Stands in for torch's DeviceMesh: mesh["data_parallel"].size()."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __getitem__(self, name):
        mesh = FakeMesh(self.sizes)
        mesh.size = lambda: self.sizes[name]
        return mesh


def test_world_size_from_device_mesh(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DeepSpeedConfig({"train_batch_size": 8}, mesh_device=FakeMesh({"data_parallel": 2, "tensor_parallel": 4}))
    assert (cfg.world_size, cfg.train_micro_batch_size_per_gpu) == (2, 4)


def test_mpu_without_dp_size_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match="get_data_parallel_world_size"):
        DeepSpeedConfig({"train_batch_size": 8}, mpu=object())


def test_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = DeepSpeedConfig({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert (cfg.world_size, cfg.train_micro_batch_size_per_gpu) == (4, 2)


def test_world_size_defaults_to_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert DeepSpeedConfig({"train_batch_size": 4}).world_size == 1


def test_bad_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DeepSpeedConfigError, match="WORLD_SIZE must be an integer, got 'two'"):
        DeepSpeedConfig({"train_batch_size": 4})


def test_world_size_from_initialised_process_group_without_collectives(monkeypatch):
    """Validation reads the world size but must never run a collective."""
    dist = torch.distributed

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran during config validation")

    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter", "all_gather_object",
                 "broadcast_object_list", "send", "recv"):
        monkeypatch.setattr(dist, name, forbidden, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
    assert (cfg.world_size, cfg.gradient_accumulation_steps) == (2, 2)


def test_config_batch_errors_and_auto():
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                         "gradient_accumulation_steps": 2}, world_size=2)
    assert "= 16" in str(info.value)
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps must be >= 1, got 0"):
        DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 0}, world_size=1)
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, world_size=1)
    assert len(info.value.errors) == 2
    assert 'train_batch_size: got "auto"' in str(info.value) and "Hugging Face" in str(info.value)


def test_batch_values_from_json_floats_and_type_errors():
    cfg = DeepSpeedConfig({"train_batch_size": 16.0, "train_micro_batch_size_per_gpu": 2.0}, world_size=2)
    assert (cfg.gradient_accumulation_steps, type(cfg.train_batch_size)) == (4, int)
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig({"train_batch_size": 2.5}, world_size=1)
    assert "train_batch_size: got 2.5; expected an integer (no fractional part)" in str(info.value)
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size: got true; expected a number, not a boolean"):
        DeepSpeedConfig({"train_batch_size": True}, world_size=1)


def test_assigned_batch_members_are_re_resolved():
    # upstream's pattern: assign the members (None: unset), then _configure_train_batch_size()
    cfg = DeepSpeedConfig({"train_batch_size": 8}, world_size=2)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 32, 8, None
    cfg._configure_train_batch_size()
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 2)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError, match="train_batch_size"):  # also a DeepSpeedConfigError
        cfg._configure_train_batch_size()
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = None, None, 2
    with pytest.raises(DeepSpeedConfigError, match="either"):
        cfg._configure_train_batch_size()
