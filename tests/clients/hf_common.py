"""Shared pieces of the Hugging Face client workers: a tiny Llama built from a config (no
downloads), a learnable token dataset, and the checks every variant runs.

Workers run under a launcher (2 ranks, gloo, CPU); they raise on a failed check and rank 0 prints
one `RESULT {...}` JSON line that the pytest side reads.
"""

from __future__ import annotations

import json
import math
import os

import torch

VOCAB, SEQ = 128, 16


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built in memory: special tokens 0-3, then
    `t4` ... `t127` (the token id after the `t`), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


class TokenData(torch.utils.data.Dataset):
    """Sequences that count up by a per-sample stride: next token is predictable, loss falls."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)}


def full_eval_loss(model, data: TokenData, device="cpu") -> float:
    """Mean loss over the whole eval set, batch by batch (every rank runs all of it: under ZeRO-3
    the forward is collective)."""
    was_training = model.training
    model.eval()
    losses = []
    with torch.no_grad():
        for lo in range(0, len(data), 8):
            ids = data.ids[lo:lo + 8].to(device)
            losses.append(float(model(input_ids=ids, labels=ids).loss.float()))
    model.train(was_training)
    return sum(losses) / len(losses)


def check_falls(losses: list[float], what: str) -> None:
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"{what}: loss did not fall ({first:.4f} -> {last:.4f}): {losses}"


def check_same(a: list[float], b: list[float], what: str, rtol: float) -> None:
    assert len(a) == len(b) and a, f"{what}: lengths differ {len(a)} vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7), f"{what}: entry {i}: {x} != {y}\n{a}\n{b}"


def compare_state_dicts(ref: dict, other: dict, what: str, atol: float = 0.0) -> int:
    """Every key of `ref` is in `other` with equal values (after casting to ref's dtype)."""
    missing = sorted(set(ref) - set(other))
    assert not missing, f"{what}: missing keys {missing[:5]}"
    for k, v in ref.items():
        w = other[k].to(v.dtype).reshape(v.shape)
        assert torch.allclose(v.float(), w.float(), atol=atol, rtol=0), \
            f"{what}: {k} differs by {(v.float() - w.float()).abs().max()}"
    return len(ref)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report(result: dict) -> None:
    if rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
