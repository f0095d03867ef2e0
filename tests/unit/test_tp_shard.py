"""Upstream's shard-size rule (deepspeed.module_inject.tp_shard), used for Ulysses' uneven head split."""

from deepspeed.module_inject import tp_shard
from deepspeed.sequence.layer import shard_sizes


def test_heads_split_like_the_attention_exchange():
    for total, parts in ((7, 4), (6, 4), (8, 2), (3, 4)):
        assert tp_shard.get_shard_size_list(total, parts) == shard_sizes(total, parts)


def test_grains_of_64_and_kv_heads():
    assert tp_shard.get_shard_size_list(4096, 3) == [1408, 1344, 1344]
    tp_shard.set_num_kv_heads(6)
    try:
        assert tp_shard.get_num_kv_heads() == 6
        assert tp_shard.get_shard_size_list(6 * 64, 4, "self_attn.q_proj") == [128, 128, 64, 64]
        assert tp_shard.get_shard_size_list(6 * 64, 4, "mlp.up_proj") == [128, 128, 64, 64]   # by grains: 6 of 64
        assert tp_shard.get_shard_size_list(384, 4, "lm_head") == [128, 128, 64, 64]
    finally:
        tp_shard.set_num_kv_heads(None)
