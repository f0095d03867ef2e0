"""Jobs for Ulysses attention: `DistributedAttention` and ALST's HF attention + data adapter, each rank on
its sequence shard, checked against the same computation on the full sequence in one process.

Every rank computes the full-sequence reference itself (same seed, no communication), so "one process on
the full sequence" is the local reference. Gradients: each rank's loss is its tokens' share of the
replica's loss, so the sum over the sequence group of the ranks' parameter gradients is the reference
gradient (the all-to-all's backward carries the other shards' contributions to this rank's q/k/v).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed.comm as dist


def _sp_groups(sp: int):
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.utils import groups

    mpu.initialize_sequence_parallel(sp)
    return groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank(), dist.get_rank() // sp


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class _CausalSDPA(nn.Module):
    """Local attention over `[s, b, h, d]` (or `[b, s, h, d]`) inputs, GQA by repetition."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first

    def forward(self, q, k, v):
        perm = (0, 2, 1, 3) if self.batch_first else (1, 2, 0, 3)  # -> [b, h, s, d]
        q, k, v = (t.permute(*perm) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(0, 2, 1, 3) if self.batch_first else out.permute(2, 0, 1, 3)


class _AttnBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, attn: nn.Module) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(hidden, heads * head_dim)
        self.k = nn.Linear(hidden, kv_heads * head_dim)
        self.v = nn.Linear(hidden, kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, hidden)
        self.attn = attn

    def forward(self, x, batch_first: bool):
        shape = x.shape[:2]
        q = self.q(x).view(*shape, self.heads, self.head_dim)
        k = self.k(x).view(*shape, self.kv_heads, self.head_dim)
        v = self.v(x).view(*shape, self.kv_heads, self.head_dim)
        if isinstance(self.attn, _CausalSDPA):
            ctx = self.attn(q, k, v)
        else:
            ctx = self.attn(q, k, v, 0 if batch_first else 1)
        return self.o(ctx.reshape(*shape, -1))


def distributed_attention(sp: int, heads: int = 4, kv_heads: int = 4, batch_first: bool = False,
                          layers: int = 2) -> dict:
    """`layers` attention blocks under DistributedAttention vs the same blocks on the full sequence:
    output slice, input gradient slice, parameter gradients (summed over the group), all-to-all bytes."""
    from deepspeed.sequence.layer import DistributedAttention

    group, sp_rank, replica = _sp_groups(sp)
    hidden, head_dim, seq, batch = 16, 8, 8 * sp, 2
    torch.manual_seed(0)
    ref_blocks = nn.ModuleList(_AttnBlock(hidden, heads, kv_heads, head_dim, _CausalSDPA(batch_first))
                               for _ in range(layers))
    sp_blocks = nn.ModuleList(
        _AttnBlock(hidden, heads, kv_heads, head_dim,
                   DistributedAttention(_CausalSDPA(batch_first), group, scatter_idx=2,
                                        gather_idx=1 if batch_first else 0)) for _ in range(layers))
    sp_blocks.load_state_dict(ref_blocks.state_dict())
    g = torch.Generator().manual_seed(100 + replica)   # each replica its own sample
    seq_dim = 1 if batch_first else 0
    full_shape = (batch, seq, hidden) if batch_first else (seq, batch, hidden)
    x_full = torch.randn(full_shape, generator=g)
    weight = torch.randn(full_shape, generator=g)

    def run(blocks, x):
        for block in blocks:
            x = x + block(x, batch_first)
        return x

    xr = x_full.clone().requires_grad_(True)
    out_ref = run(ref_blocks, xr)
    (out_ref * weight).sum().backward()

    chunk = seq // sp
    sl = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    x_local = x_full.narrow(seq_dim, chunk * sp_rank, chunk).clone().requires_grad_(True)
    dist.comms_counter.reset()
    out = run(sp_blocks, x_local)
    fwd = dist.comms_counter.summary().get("all_to_all_single", {})
    (out * weight.narrow(seq_dim, chunk * sp_rank, chunk)).sum().backward()
    total = dist.comms_counter.summary().get("all_to_all_single", {})

    out_err = (out - out_ref.detach().narrow(seq_dim, chunk * sp_rank, chunk)).abs().max().item()
    xgrad_err = (x_local.grad - xr.grad.narrow(seq_dim, chunk * sp_rank, chunk)).abs().max().item()
    grad_err = max((_sum_over(p.grad, group) - r.grad).abs().max().item()
                   for p, r in zip(sp_blocks.parameters(), ref_blocks.parameters()))
    del sl
    tokens = chunk * batch
    return {"out_err": out_err, "xgrad_err": xgrad_err, "grad_err": grad_err,
            "fwd_count": fwd.get("count", 0), "fwd_bytes": fwd.get("bytes", 0),
            "total_count": total.get("count", 0), "total_bytes": total.get("bytes", 0),
            # theory per layer and direction: q and the output move heads*d per local token, k and v kv_heads*d
            "theory_fwd_bytes": layers * tokens * head_dim * (2 * heads + 2 * kv_heads) * 4}


def exchange_roundtrip(sp: int, heads: int, batch_first: bool) -> float:
    """s->h then h->s through `_SeqAllToAll` returns the input; s->h puts head block r on rank r."""
    from deepspeed.sequence.layer import _SeqAllToAll, shard_sizes

    group, sp_rank, _ = _sp_groups(sp)
    b, s_local, d = 2, 3, 4
    seq_dim = 1 if batch_first else 0
    # value encodes (global position, head): checks where every element lands
    pos = torch.arange(s_local) + s_local * sp_rank
    h = torch.arange(heads)
    code = pos.view(-1, 1) * 100 + h.view(1, -1)                      # [s, h]
    x = code.view(1, s_local, heads, 1).expand(b, s_local, heads, d).float()
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    s2h = _SeqAllToAll.apply(group, x, 2, seq_dim, 0)
    sizes = shard_sizes(heads, sp)
    h0 = sum(sizes[:sp_rank])
    want = (torch.arange(s_local * sp).view(-1, 1) * 100 + torch.arange(h0, h0 + sizes[sp_rank]).view(1, -1))
    got = s2h.select(3, 0).select(1 - seq_dim, 0)
    assert torch.equal(got, want.float()), (got, want)
    back = _SeqAllToAll.apply(group, s2h, seq_dim, 2, 0)   # the ranks' head counts are asked of the group
    return (back - x).abs().max().item()


# ---- ALST: transformers' Llama with the registered Ulysses attention ----

def _tiny_llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _samples(sp: int, replica: int) -> list[dict]:
    """One sample per rank of the group, of different lengths, labels with -100 spread unevenly (the first
    sample's last shards have none valid, another has its only valid tokens at a shard edge)."""
    g = torch.Generator().manual_seed(7 + replica)
    out = []
    for i in range(sp):
        n = (2 + (i % 3)) * 4 * sp // 2 if sp > 1 else 8
        ids = torch.randint(0, 61, (1, n), generator=g)
        labels = ids.clone()
        if i % 2 == 0:
            labels[:, n // 3:] = -100
        else:
            labels[:, : n // 2 - 1] = -100
            labels[:, n // 2 + 1:-1] = -100
        out.append({"input_ids": ids, "position_ids": torch.arange(n).view(1, -1), "labels": labels})
    return out


def alst_llama(sp: int, kv_heads: int = 2) -> dict:
    """Each rank's loader yields its sample; through the adapter each step is one sample of the group, sharded.
    Logits, loss and gradients on the shards must equal the full-sequence model's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = _tiny_llama(kv_heads)
    _, _, replica = dist.get_rank(), None, dist.get_rank() // sp
    samples = _samples(sp, replica)
    refs = []
    for s in samples:   # reference: the unmodified model on the full sequence
        model.zero_grad()
        logits = model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
        labels = F.pad(s["labels"], (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        refs.append((logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model,
                                                              core_attn_implementation="sdpa",
                                                              sequence_parallel_size=sp, micro_batch_size=1,
                                                              seq_length_is_variable=True)
        assert mpu is parallel_state_sp
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        mine = samples[sp_rank]
        dl = torch.utils.data.DataLoader([mine], batch_size=None)
        adapter = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=group, sp_world_size=sp,
                                             device=torch.device("cpu"))
        assert len(adapter) == sp
        errs = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
        count = 0
        for step, batch in enumerate(adapter):
            count += 1
            ref_logits, ref_loss, ref_grads = refs[step]
            model.zero_grad()
            shift = batch.pop("shift_labels")
            assert "labels" not in batch
            logits = model(**batch).logits
            n = shift.shape[1]
            errs["logits"] = max(errs["logits"], (logits - ref_logits[:, n * sp_rank:n * (sp_rank + 1)]).abs().max().item())
            valid = _sum_over((shift != -100).sum().float(), group)
            local = F.cross_entropy(logits.view(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100,
                                    reduction="sum") / valid
            local.backward()
            errs["loss"] = max(errs["loss"], abs(_sum_over(local.detach(), group).item() - ref_loss.item()))
            for name, p in model.named_parameters():
                errs["grad"] = max(errs["grad"], (_sum_over(p.grad, group) - ref_grads[name]).abs().max().item())
        assert count == sp, count
        return errs
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def adapter_batches(sp: int) -> list[dict]:
    """The adapter's slices on this rank, for upstream's sample (input 1,10,10,10,2,2)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    group, sp_rank, _ = _sp_groups(sp)
    ids = torch.tensor([[1, 10, 10, 10, 2, 2]]) + 100 * sp_rank
    batch = {"input_ids": ids, "position_ids": torch.arange(6).view(1, -1), "labels": ids.clone(), "tag": sp_rank}
    dl = torch.utils.data.DataLoader([batch], batch_size=None)
    return list(UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=group, sp_world_size=sp, device="cpu"))


def alst_disable_in_eval(sp: int) -> float:
    """With disable_in_eval, an eval-mode model runs the core attention on whatever it is given (the full
    sequence here), exactly as without Ulysses; in training mode the same call goes through Ulysses."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = _tiny_llama(2).eval()
    s = _samples(sp, 0)[0]
    with torch.no_grad():
        ref = model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
    try:
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, disable_in_eval=True)
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, disable_in_eval=True)  # no double wrap
        assert ALL_ATTENTION_FUNCTIONS["sdpa"]._ulysses_core is original
        with torch.no_grad():
            got = model(input_ids=s["input_ids"], position_ids=s["position_ids"]).logits
        assert torch.equal(got, ref)
        model.train()
        with torch.no_grad():   # training mode: sequence-parallel, each rank's tokens are a shard now
            n = s["input_ids"].shape[1] // sp
            r = dist.get_rank() % sp
            shard = model(input_ids=s["input_ids"][:, n * r:n * (r + 1)],
                          position_ids=s["position_ids"][:, n * r:n * (r + 1)]).logits
        return (shard - ref[:, n * r:n * (r + 1)]).abs().max().item()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
