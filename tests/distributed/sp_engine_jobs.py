"""Jobs for the engine under sequence parallelism: each rank trains on its sequence shard of its replica's
micro-batch; the result must equal one process training on the full sequences of the same global batch.

The model mixes tokens across the sequence (each position adds the running mean of the hidden states
before it: a causal, attention-like dependency), so gradients reach other shards' parameters' uses only
through the differentiable all_gather of hidden states, as they would through Ulysses' all-to-all.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

VOCAB, HIDDEN, SEQ = 23, 16, 12


class _AllGather(torch.autograd.Function):
    """Differentiable all_gather through deepspeed.comm: backward sums every rank's gradient for this
    rank's piece (what torch.distributed.nn.functional.all_gather does; its gloo backward addresses
    subgroups by group rank where torch wants global ranks, so it fails for SP groups other than the
    first: torch's bug, not reachable on NCCL, hence this stand-in in the tests)."""

    @staticmethod
    def forward(ctx, tensor, group):
        import deepspeed.comm as dist

        ctx.group = group
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        import deepspeed.comm as dist

        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def all_gather(tensor: torch.Tensor, group) -> tuple:
    return _AllGather.apply(tensor, group)


class CausalMixLM(nn.Module):
    """Embedding -> causal running-mean mixing across the whole sequence -> MLP -> vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.sp_group = None   # set under sequence parallelism: hidden states are all-gathered over it
        self.mix_tokens = True   # False: every token on its own (a shard's loss depends on its tokens only)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)                                   # [b, s_local, h]
        full, start = h, 0
        if not self.mix_tokens:
            h = h + torch.tanh(self.mix(h))
            return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))
        if self.sp_group is not None:
            import deepspeed.comm as dist

            parts = all_gather(h, self.sp_group)   # differentiable
            full = torch.cat(parts, dim=1)
            start = dist.get_rank(self.sp_group) * h.shape[1]
        steps = torch.arange(1, full.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        prefix_mean = full.cumsum(dim=1) / steps
        h = h + torch.tanh(self.mix(prefix_mean[:, start:start + h.shape[1]]))
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)


def make_data(steps: int, batch: int, seed: int = 0, repeat: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and next-token labels with -100 spread unevenly (some shards nearly all ignored).
    `repeat`: each sequence is its first 1/repeat repeated (identical shards at sp = repeat)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        ignore = torch.rand(batch, SEQ, generator=g) < torch.linspace(0.0, 0.8, SEQ)   # more towards the end
        labels[ignore] = -100
        labels[0, :SEQ // 2] = -100    # the first sample's first half: nothing to learn there
        if repeat > 1:
            ids, labels = (t[:, :SEQ // repeat].repeat(1, repeat) for t in (ids, labels))
        out.append((ids, labels))
    return out


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100,
                                       reduction="sum")


def reference(steps: int, dp: int, micro: int, gas: int, lr: float, clip: float, repeat: int = 1,
              mix_tokens: bool = True) -> dict:
    """One process, full sequences: the loss of a replica's micro-batch is the mean over its valid tokens,
    gradients averaged over replicas and micro-steps, then SGD (scale-sensitive, unlike Adam)."""
    torch.manual_seed(1234)
    model = CausalMixLM()
    model.mix_tokens = mix_tokens
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for ids, labels in make_data(steps, dp * micro * gas, repeat=repeat):
        opt.zero_grad()
        for k in range(gas):
            for d in range(dp):
                rows = slice((k * dp + d) * micro, (k * dp + d + 1) * micro)
                loss = _ce_sum(model(ids[rows]), labels[rows]) / (labels[rows] != -100).sum()
                (loss / (dp * gas)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def train_sp(steps: int, sp: int, stage: int, convention: str, micro: int = 2, gas: int = 1, lr: float = 0.5,
             clip: float = 0.0, dtype: str = "fp32", extra: dict | None = None, save_dir: str | None = None,
             load_dir: str | None = None, via_mpu: bool = False, repeat: int = 1, mix_tokens: bool = True,
             declare: str | None = None, bare: bool = False) -> dict:
    """Every rank: its replica's micro-batch, its sequence shard. `convention`: "whole" (every SP rank
    holds the replica's loss, joined as Hugging Face's deepspeed_sp_compute_loss does) or "share" (each
    SP rank its part of it: local sum / the replica's valid-token count). `declare`: set as
    engine.sequence_parallel_loss; `bare`: `loss.backward()`, not engine.backward. `value_tests`: per
    backward, the float64 scalar all_gathers (the engine's value test of the loss)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    torch.manual_seed(1234)
    model = CausalMixLM()
    model.mix_tokens = mix_tokens
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "sequence_parallel_size": sp, "optimizer": {"type": "SGD", "params": {"lr": lr}},
              "gradient_clipping": clip, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(copy.deepcopy(extra or {}))
    mpu = None
    if via_mpu:   # ALST's way: the groups first, handed over as `mpu`, no key in the config
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

        mpu.initialize_sequence_parallel(sp)
        del config["sequence_parallel_size"]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    engine.sequence_parallel_loss = declare
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    sp_group = groups._get_sequence_parallel_group() if sp > 1 else None
    model.sp_group = sp_group
    sp_rank, dp_rank, dp = groups._get_sequence_parallel_rank(), engine.get_data_parallel_rank(), engine.dp_world_size
    assert dp == dist.get_world_size() // sp and engine.seq_dp_world_size == dist.get_world_size()
    assert engine.train_batch_size() == micro * gas * dp
    shard = SEQ // sp
    cols = slice(sp_rank * shard, (sp_rank + 1) * shard)
    losses, norms, value_tests = [], [], []
    for ids, labels in make_data(steps, dp * micro * gas, repeat=repeat):
        for k in range(gas):
            rows = slice((k * dp + dp_rank) * micro, (k * dp + dp_rank + 1) * micro)
            x, y = ids[rows][:, cols], labels[rows][:, cols]
            ce = _ce_sum(engine(x), y)
            count = (y != -100).sum()
            if convention == "whole":   # transformers' deepspeed_sp_compute_loss, verbatim in effect
                local = ce / count.clamp(min=1)
                per_rank = torch.stack(all_gather(local, sp_group)) if sp > 1 else local.view(1)
                counts = torch.stack(all_gather(count, sp_group)) if sp > 1 else count.view(1)
                loss = (torch.where(counts > 0, per_rank, torch.zeros_like(per_rank)) * counts).sum() / counts.sum()
            else:
                total = count.clone()
                if sp > 1:
                    dist.all_reduce(total, group=sp_group)
                loss = ce / total
            dist.comms_counter.reset()
            dist.comms_counter.keep_records = True
            try:
                loss.backward() if bare else engine.backward(loss)
            finally:
                dist.comms_counter.keep_records = False
            value_tests.append(sum(r.op == "all_gather" and r.dtype == "torch.float64" and r.numel == 1
                                   for r in dist.comms_counter.records))
            engine.step()
            losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="sp")
    params, moments = {}, {}
    for name, p in engine.module.named_parameters():
        full = deepspeed.utils.safe_get_full_fp32_param(p) if stage == 3 or dtype != "fp32" else p.detach()
        params[name] = full.detach().clone().float()
        if engine._config.model.optimizer.type.lower() == "adamw":
            moments[name] = deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg").clone()
    return {"params": params, "norms": norms, "losses": losses, "exp_avg": moments, "value_tests": value_tests}
