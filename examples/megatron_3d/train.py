"""3-D parallelism the way Megatron-DeepSpeed trains: pipeline x tensor x data.

    deepspeed --num_gpus 8 examples/megatron_3d/train.py --pp 2 --tp 2     # 2 stages x 2 slices x 2 replicas
    deepspeed --num_gpus 4 examples/megatron_3d/train.py --pp 2 --tp 2     # 2 x 2 x 1

A tiny GPT-style stack of Megatron-style tensor-parallel blocks of our own (column-parallel FFN in,
row-parallel FFN out, the sharded weights tagged `tensor_model_parallel`, LayerNorms and the row
bias replicated) in a `PipelineModule` over `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`,
ZeRO-1 over the data axis and gradient clipping. The tensor layers take their group from the
pipeline grid (`get_slice_parallel_group()`), as Megatron's layers take theirs from its mpu; as
upstream, no `mpu=` is passed to `deepspeed.initialize` with a PipelineModule. It is a plain
DeepSpeed script (it also runs on upstream DeepSpeed). With `--check`, rank 0 trains the same
model unsharded in one process on the same global batches and prints the largest difference of the
losses and of the global gradient norm (the norm counts every element once: each tensor slice once,
the replicated parameters once, every stage once). On CPU each rank uses one thread; the
launcher starts the ranks and they talk over gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

VOCAB, HIDDEN, FFN, SEQ, BLOCKS = 64, 32, 64, 16, 4


def initial(layer: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A weight's unsharded initial value, the same on every rank (each rank keeps its slice)."""
    g = torch.Generator().manual_seed(1000 * layer + sum(map(ord, name)))
    return torch.randn(shape, generator=g) * 0.05


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over the tensor group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelBlock(nn.Module):
    """x + RowParallel(gelu(ColumnParallel(LayerNorm(x)))): the FFN columns split over `tp` ranks."""

    def __init__(self, layer: int, tp: int, tp_rank: int, group_fn) -> None:
        super().__init__()
        cols = slice(tp_rank * FFN // tp, (tp_rank + 1) * FFN // tp)
        self.group_fn = group_fn
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc_in = nn.Parameter(initial(layer, "fc_in", (FFN, HIDDEN))[cols].clone())
        self.fc_in_bias = nn.Parameter(torch.zeros(FFN)[cols].clone())
        self.fc_out = nn.Parameter(initial(layer, "fc_out", (HIDDEN, FFN))[:, cols].clone())
        self.fc_out_bias = nn.Parameter(torch.zeros(HIDDEN))   # added after the reduction: replicated
        # Megatron's tags (zero_to_fp32 joins the slices of a checkpoint along partition_dim)
        for p, dim in ((self.fc_in, 0), (self.fc_in_bias, 0), (self.fc_out, 1)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    def forward(self, x):
        group = self.group_fn()
        h = CopyToTensorParallel.apply(self.norm(x), group)
        h = nn.functional.gelu(nn.functional.linear(h, self.fc_in, self.fc_in_bias))
        return x + ReduceFromTensorParallel.apply(nn.functional.linear(h, self.fc_out), group) + self.fc_out_bias


class Embedding(nn.Embedding):
    def __init__(self) -> None:
        super().__init__(VOCAB, HIDDEN)
        with torch.no_grad():
            self.weight.copy_(initial(100, "embed", (VOCAB, HIDDEN)))


class Head(nn.Linear):
    def __init__(self) -> None:
        super().__init__(HIDDEN, VOCAB)
        with torch.no_grad():
            self.weight.copy_(initial(101, "head", (VOCAB, HIDDEN)))
            self.bias.zero_()


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up modulo the vocabulary from a random start: learnable next tokens."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    ids = (start + torch.arange(SEQ + 1)) % VOCAB
    return ids[:, :-1], ids[:, 1:]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Megatron-style 3-D parallelism with DeepSpeed")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel slices")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--gas", type=int, default=4, help="micro-batches per step (per replica)")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--clip", type=float, default=0.1)
    p.add_argument("--check", action="store_true", help="compare with one process on the unsharded model")
    return p.parse_args()


def reference(args, dp: int) -> tuple[list[float], list[float]]:
    """The same model unsharded in one process, the same global batches: (losses, gradient norms)."""
    blocks = [ParallelBlock(i, 1, 0, lambda: None) for i in range(BLOCKS)]
    model = nn.Sequential(Embedding(), *blocks, Head())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(args.steps):
        ids, labels = global_batch(step, args.micro_batch * args.gas * dp)
        loss = lm_loss(model(ids), labels)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (args.pp * args.tp):
        raise SystemExit(f"world size {world} is not a multiple of pp x tp = {args.pp * args.tp}")
    dp = world // (args.pp * args.tp)
    topology = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=dp)
    tp_rank = topology.get_coord(rank).model
    holder: dict = {}

    def tensor_group():   # the grid exists once the PipelineModule is built
        return holder["module"].mpu().get_slice_parallel_group() if args.tp > 1 else None

    layers = ([LayerSpec(Embedding)] + [LayerSpec(ParallelBlock, i, args.tp, tp_rank, tensor_group)
                                        for i in range(BLOCKS)] + [LayerSpec(Head)])
    model = holder["module"] = PipelineModule(layers, topology=topology, loss_fn=lm_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
              "train_batch_size": args.micro_batch * args.gas * dp, "gradient_clipping": args.clip,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": args.zero_stage}, "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    replica = engine.grid.get_data_parallel_id()
    losses, norms = [], []
    for step in range(args.steps):
        ids, labels = global_batch(step, args.micro_batch * args.gas * dp)
        mine = [(ids[s:s + args.micro_batch], labels[s:s + args.micro_batch])
                for s in range(replica * args.gas * args.micro_batch, (replica + 1) * args.gas * args.micro_batch,
                               args.micro_batch)]
        losses.append(float(engine.train_batch(iter(mine))))
        norms.append(engine.get_global_grad_norm())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {norms[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"pipeline {args.pp} x tensor {args.tp} x data {dp} on {world} ranks, ZeRO-{args.zero_stage}: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        if args.check:
            want_losses, want_norms = reference(args, dp)
            loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
            norm_gap = max(abs(a - b) / abs(b) for a, b in zip(norms, want_norms))
            print(f"check against one process: max relative difference of losses {loss_gap:.2e}, "
                  f"of gradient norms {norm_gap:.2e}", flush=True)
            if max(loss_gap, norm_gap) > 1e-4:
                raise SystemExit("3-D training differs from one process")
    engine.destroy()


if __name__ == "__main__":
    main()
