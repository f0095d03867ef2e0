"""The pieces of the deepspeed surface Lightning's DeepSpeedStrategy needs beyond the engine
(tests/clients/test_lightning.py runs the real thing)."""

import pytest

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig


def test_checkpointing_configure_records_lightning_call():
    deepspeed.checkpointing.configure(mpu_=None, partition_activations=False, contiguous_checkpointing=False,
                                      checkpoint_in_cpu=False, profile=None)   # Lightning's exact call
    assert deepspeed.checkpointing.is_configured()
    s = deepspeed.checkpointing.settings()
    assert not s.partition_activations and not s.checkpoint_in_cpu and not s.profile


def test_checkpointing_configure_from_config_then_arguments():
    cfg = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "profile": True}}
    deepspeed.checkpointing.configure(None, deepspeed_config=cfg, profile=False)
    s = deepspeed.checkpointing.settings()
    assert s.partition_activations and s.checkpoint_in_cpu and not s.profile
    with pytest.raises(ValueError, match="requires partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=False, contiguous_checkpointing=True,
                                          num_checkpoints=2)
    deepspeed.checkpointing.configure(None)   # back to the defaults for later tests in this process


def test_aio_thread_count_accepted():
    # Lightning's default config writes the pre-0.15 key aio.thread_count; DeepSpeed ignores it
    DeepSpeedConfig({"train_batch_size": 1, "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                                                     "single_submit": False, "overlap_events": True}}, world_size=1)


def test_zero_to_fp32_file_helpers(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_model_state_file, get_optim_files

    for r in (0, 1, 2, 10):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert [p.split("rank_")[1].split("_")[0] for p in get_optim_files(tmp_path)] == ["0", "1", "2", "10"]
    assert get_model_state_file(tmp_path, 2).endswith("mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError):
        get_model_state_file(tmp_path, 3)
    with pytest.raises(FileNotFoundError):
        get_optim_files(tmp_path / "missing")
