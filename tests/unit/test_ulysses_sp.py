"""ALST's registration checks and the adapter's label shift, without processes (no collective is reached)."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.sequence_parallel import ulysses_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, _shard
from deepspeed.sequence.layer import shard_sizes


def _config(impl="sdpa"):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                       attn_implementation=impl)


def _register(impl, config_impl=None, **kw):
    return UlyssesSPAttentionHF.register_with_transformers(_config(config_impl or impl), impl, 2, 1, **kw)


@pytest.mark.parametrize("impl", ["eager", "flex_attention"])
def test_refused_implementations_name_themselves(impl):
    with pytest.raises(ValueError, match=impl):
        _register(impl)


def test_config_implementation_must_match():
    with pytest.raises(ValueError, match="does not match model config attn_implementation='sdpa'"):
        _register("flash_attention_2", config_impl="sdpa")


def test_fixed_length_needs_seq_length():
    with pytest.raises(ValueError, match="seq_length"):
        _register("sdpa", seq_length_is_variable=False)


def test_sp1_is_a_no_op():
    assert UlyssesSPAttentionHF.register_with_transformers(_config(), "sdpa", 1, 1) is None


def test_shift_labels_keep_the_target_across_shard_edges():
    labels = torch.tensor([[5, 6, -100, 8, 9, 10, 11, 12]])
    batch = {"input_ids": torch.arange(8).view(1, -1), "labels": labels, "position_ids": torch.arange(8).view(1, -1)}
    shards = [_shard(dict(batch), r, 4) for r in range(4)]
    got = torch.cat([s["shift_labels"] for s in shards], dim=1)
    assert torch.equal(got, torch.tensor([[6, -100, 8, 9, 10, 11, 12, -100]]))
    assert torch.equal(shards[1]["shift_labels"], torch.tensor([[8, 9]]))   # token 3's target is on shard 2
    assert all("labels" not in s for s in shards)
    with pytest.raises(ValueError, match="seqlen=8 isn't divisible by sp-size=3"):
        _shard(dict(batch), 0, 3)


def test_shard_sizes_put_the_extra_heads_first():
    assert shard_sizes(7, 4) == [2, 2, 2, 1] and shard_sizes(8, 4) == [2, 2, 2, 2] and shard_sizes(3, 4) == [1, 1, 1, 0]


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        ulysses_sp.NoSuchThing
