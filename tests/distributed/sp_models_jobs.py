"""Jobs for two real models under the engine with sequence parallelism, each against one process training
on the full sequences of the same global batch (the references run in the test process):

- a tiny Hugging Face Llama (4 query heads, 2 key/value heads) whose sdpa attention is routed through ALST
  (`UlyssesSPAttentionHF.register_with_transformers` with the model object), fed by
  `UlyssesSPDataLoaderAdapter`, its shard losses joined as transformers' `deepspeed_sp_compute_loss`
  does (every SP rank holds the sample's token-weighted loss: the "whole" convention);
- a plain-PyTorch GPT whose attention is `deepspeed.sequence.layer.DistributedAttention` (Megatron's
  `[s, b, h, d]` layout), each rank's loss its share of the replica's (local sum / replica tokens).

The differentiable gather is sp_engine_jobs.all_gather (deepspeed.comm): torch's own fails on gloo for SP
groups other than the first.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sp_engine_jobs import all_gather

VOCAB, HIDDEN, HEADS, KV_HEADS = 96, 64, 4, 2


# ---------------------------------------------------------------- data

def llama_data(steps: int, dp: int, micro: int, variable: int, seed: int = 0) -> list[list[dict]]:
    """data[k][d]: replica d's micro-batch at step k (input_ids, position_ids, unshifted labels). With
    `variable` > 0 lengths (8 to 32, divisible by 4) change every `variable` steps and between replicas:
    `variable` = sp keeps one length across the batches an SP group's ranks draw together, 1 gives each
    its own. Labels ignore a prompt of random length and random holes, and replica 0's first batch
    ignores its whole first half (an SP shard with nothing to learn)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (16, 24, 8, 32) if variable else (16, )
    out = []
    for k in range(steps):
        row = []
        for d in range(dp):
            n = lengths[(k // max(variable, 1) + 3 * d) % len(lengths)]
            ids = torch.randint(0, VOCAB, (micro, n), generator=g)
            labels = ids.clone()
            prompt = torch.randint(0, n // 2 + 2, (micro, 1), generator=g)
            labels[(torch.arange(n).view(1, n) < prompt) | (torch.rand(micro, n, generator=g) < 0.2)] = -100
            if k == 0 and d == 0:
                labels[:, :n // 2 + 1] = -100
            row.append({"input_ids": ids, "position_ids": torch.arange(n).expand(micro, n).clone(), "labels": labels})
        out.append(row)
    return out


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy over valid labels, their count)."""
    ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                     ignore_index=-100, reduction="sum")
    return ce, (labels != -100).sum()


def _sgd_reference(model: nn.Module, batches: list[list[tuple]], forward, lr: float, clip: float) -> dict:
    """One process: per step the mean over replicas of each replica's mean loss over its valid tokens,
    clipped SGD. Returns losses[k][d], pre-clip norms, the first step's gradients and the final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms, grads0 = [], [], None
    for row in batches:
        opt.zero_grad()
        step = []
        for inputs, labels in row:
            ce, count = _ce(forward(model, inputs), labels)
            loss = ce / count.clamp(min=1)
            (loss / len(row)).backward()
            step.append(float(loss.detach()))
        if grads0 is None:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(step)
    return {"losses": losses, "norms": norms, "grads0": grads0,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------- the Llama under ALST

def new_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return LlamaForCausalLM(cfg)


def _llama_forward(model, inputs):
    return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits


def llama_reference(steps: int, dp: int, micro: int, variable: int, lr: float, clip: float) -> dict:
    batches = [[(b, shifted(b["labels"])) for b in row] for row in llama_data(steps, dp, micro, variable)]
    return _sgd_reference(new_llama(), batches, _llama_forward, lr, clip)


def _engine_config(micro: int, sp: int, stage: int, lr: float, clip: float, dtype: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "sequence_parallel_size": sp, "optimizer": {"type": "SGD", "params": {"lr": lr}},
              "gradient_clipping": clip, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _results(engine, losses: list, norms: list, grads0: dict) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    params = {n: safe_get_full_fp32_param(p).detach().clone().float() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "grads0": grads0, "params": params}


def _full_grads(engine) -> dict:
    """Every parameter's whole gradient after backward, before the step (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone().float() for n, p in engine.module.named_parameters()}


def train_llama(steps: int, sp: int, stage: int, micro: int = 2, variable: int = 0, lr: float = 0.5,
                clip: float = 1.0, dtype: str = "fp32", join: bool = True) -> dict:
    """Every rank: ALST attention, the adapter's shards of its replica's batches, HF's loss join (`join`
    False: each rank's share of the loss instead, local sum / the replica's tokens, which the engine refuses
    on this path). `value_tests`: per backward, the engine's all_gathers of the loss value."""
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups.mpu = None   # this pool's earlier jobs may have handed an engine another mpu
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        model = new_llama()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=micro, seq_length=None if variable else 16, seq_length_is_variable=bool(variable))
        engine, _, _, _ = deepspeed.initialize(model=model, config=_engine_config(micro, sp, stage, lr, clip, dtype),
                                               mpu=mpu)
        group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
        dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
        draws = math.ceil(steps / sp)
        data = llama_data(draws * sp, dp, micro, variable)
        # the adapter gives the SP group the batch each of its ranks drew, in rank order: this rank draws
        # the batches of the steps j * sp + sp_rank
        mine = [data[j * sp + sp_rank][dp_rank] for j in range(draws)]
        loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=None), sp_rank=sp_rank,
                                            sp_group=group, sp_world_size=sp, device=engine.device)
        losses, norms, grads0, value_tests = [], [], None, []
        for k, batch in zip(range(steps), loader):
            assert batch["input_ids"].shape[1] == data[k][dp_rank]["input_ids"].shape[1] // sp
            ce, count = _ce(_llama_forward(engine, batch), batch["shift_labels"])
            local = ce / count.clamp(min=1)
            per_rank, counts = torch.stack(all_gather(local, group)), torch.stack(all_gather(count, group))
            loss = (per_rank * counts).sum() / counts.sum() if join else ce / counts.sum()
            ds_comm.comms_counter.reset()
            ds_comm.comms_counter.keep_records = True
            try:
                engine.backward(loss)
            finally:
                ds_comm.comms_counter.keep_records = False
            value_tests.append(sum(r.op == "all_gather" and r.dtype == "torch.float64" and r.numel == 1
                                   for r in ds_comm.comms_counter.records))
            if grads0 is None and dtype == "fp32":
                grads0 = _full_grads(engine)
            engine.step()
            losses.append(float(loss.detach()))
            norms.append(engine.get_global_grad_norm())
        return {**_results(engine, losses, norms, grads0), "value_tests": value_tests}
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        groups.mpu = None


# ---------------------------------------------------------------- a plain GPT with DistributedAttention

GPT_SEQ = 16


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over every token of this rank's heads, `[s, b, h, d]` in and out."""
    out = nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3)


class _Block(nn.Module):
    def __init__(self, sp_group) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.attn = _local_attention if sp_group is None else DistributedAttention(_local_attention, sp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [s, b, hidden]
        s, b, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, HEADS, HIDDEN // HEADS).unbind(2)
        x = x + self.proj(self.attn(q, k, v).reshape(s, b, HIDDEN))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, 2 pre-norm blocks, Megatron's sequence-first layout inside."""

    def __init__(self, sp_group=None) -> None:
        super().__init__()
        self.sp_group = sp_group
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(GPT_SEQ, HIDDEN)
        self.blocks = nn.ModuleList([_Block(sp_group) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:   # [b, s_local] -> [b, s_local, vocab]
        start = 0
        if self.sp_group is not None:
            import deepspeed.comm as dist

            start = dist.get_rank(self.sp_group) * ids.shape[1]
        x = (self.embed(ids) + self.pos(torch.arange(start, start + ids.shape[1]))).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).transpose(0, 1)


def gpt_data(steps: int, dp: int, micro: int, seed: int = 1) -> list[list[tuple]]:
    """data[k][d] = (ids, next-token labels) of replica d at step k; -100 denser towards the end."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        row = []
        for _ in range(dp):
            ids = torch.randint(0, VOCAB, (micro, GPT_SEQ + 1), generator=g)
            labels = ids[:, 1:].clone()
            labels[torch.rand(micro, GPT_SEQ, generator=g) < torch.linspace(0.0, 0.7, GPT_SEQ)] = -100
            row.append((ids[:, :-1], labels))
        out.append(row)
    return out


def new_gpt(sp_group=None) -> TinyGPT:
    torch.manual_seed(4321)
    return TinyGPT(sp_group)


def gpt_reference(steps: int, dp: int, micro: int, lr: float, clip: float) -> dict:
    return _sgd_reference(new_gpt(), gpt_data(steps, dp, micro), lambda m, ids: m(ids), lr, clip)


def train_gpt(steps: int, sp: int, stage: int, micro: int = 2, lr: float = 0.5, clip: float = 1.0) -> dict:
    """Every rank: its sequence slice of its replica's batch; loss = local sum / the replica's valid tokens."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    groups.mpu = None
    parallel_state_sp.initialize_sequence_parallel(sp)   # the groups first: the model's attention holds one
    group = groups._get_sequence_parallel_group()
    engine, _, _, _ = deepspeed.initialize(model=new_gpt(group), config=_engine_config(micro, sp, stage, lr, clip,
                                                                                        "fp32"))
    sp_rank, dp, dp_rank = groups._get_sequence_parallel_rank(), engine.dp_world_size, engine.get_data_parallel_rank()
    shard = GPT_SEQ // sp
    cols = slice(sp_rank * shard, (sp_rank + 1) * shard)
    losses, norms, grads0 = [], [], None
    for row in gpt_data(steps, dp, micro):
        ids, labels = row[dp_rank]
        ce, count = _ce(engine(ids[:, cols]), labels[:, cols])
        total = count.clone()
        dist.all_reduce(total, group=group)
        loss = ce / total.clamp(min=1)
        engine.backward(loss)
        if grads0 is None:
            grads0 = _full_grads(engine)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)   # the replica's loss, for the comparison
        losses.append(float(whole))
        norms.append(engine.get_global_grad_norm())
    return _results(engine, losses, norms, grads0)


def adapter_shards(micro: int, sp: int) -> list[dict]:
    """The adapter's shards of one batch of `micro` samples: per shard, each tensor's contiguity."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    groups.mpu = None
    parallel_state_sp.initialize_sequence_parallel(sp)
    batch = llama_data(1, 1, micro, 0)[0][0]
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader([batch], batch_size=None),
                                        sp_rank=groups._get_sequence_parallel_rank(),
                                        sp_group=groups._get_sequence_parallel_group(), sp_world_size=sp,
                                        device=torch.device("cpu"))
    return [{k: v.is_contiguous() for k, v in shard.items() if torch.is_tensor(v)} for shard in loader]
