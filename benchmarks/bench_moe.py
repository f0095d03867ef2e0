"""Expert parallelism: a small MoE GPT on 4 ranks at ep=1 (every rank holds every expert) vs ep=2 and
ep=4, ours and, where /tmp/ds-venv holds it, DeepSpeed 0.19.8 with its `deepspeed.moe.layer.MoE`.

    python benchmarks/bench_moe.py [--ranks 4] [--eps 1,2,4] [--steps 6] [--impls ours,ds]

Counted per rank (numel * element_size): expert parameters, all parameters, optimizer state; per step:
the bytes every all_to_all_single of the step sends (torch.distributed's entry wrapped in each rank:
the same count for both implementations), tokens/s (global tokens / slowest rank's wall time) and
CPU s/step (time.process_time, slowest rank). Each case is a fresh set of processes; ZeRO-1, fp32,
Adam. The model: token embedding + `layers` blocks of (causal self-attention, MoE MLP with top-1
gating) + LM head; the MoE layer is `deepspeed.moe.layer.MoE` (capacity_factor 1.0, min_capacity 4,
upstream's defaults otherwise) when the implementation builds it, else (ours before the layer
lands) the bench's `Top1MoE` (top-1, no capacity: every token reaches its expert).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _ds_child import (add_impl_args, chosen_impls, optimizer_state_bytes, run_case_and_report, run_child,  # noqa: E402
                       tensor_bytes)


def _model(cfg: dict, ep: int, ep_rank: int):
    import torch
    from torch import nn

    class _A2A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, group, x):
            import deepspeed.comm as dist

            ctx.group, x = group, x.contiguous()
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return None, _A2A.apply(ctx.group, grad)

    class Top1MoE(nn.Module):
        """Top-1 expert-parallel MLP with upstream's engine-facing surface (see module docstring)."""

        def __init__(self, hidden, expert, num_experts, ep_size):
            super().__init__()
            self.num_experts, self.ep_size = num_experts, ep_size
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.deepspeed_moe = nn.Module()
            self.deepspeed_moe.gate = nn.Module()
            self.deepspeed_moe.gate.wg = nn.Linear(hidden, num_experts, bias=False)
            self.deepspeed_moe.experts = nn.Module()
            self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(expert() for _ in
                                                                         range(self.num_local_experts))
            for p in self.deepspeed_moe.experts.parameters():
                p.allreduce, p.group_name = False, self.expert_group_name

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            from deepspeed.utils import groups

            groups._create_expert_and_data_parallel(self.ep_size)
            self.group = groups._get_expert_parallel_group(self.expert_group_name)

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            probs = torch.softmax(self.deepspeed_moe.gate.wg(x), -1)
            index = probs.argmax(-1)
            mask = torch.nn.functional.one_hot(index, self.num_experts).T.unsqueeze(-1).to(x.dtype)
            routed = mask * x.unsqueeze(0)
            if self.ep_size > 1:
                routed = _A2A.apply(self.group, routed)
            local = routed.reshape(-1, self.num_local_experts, *x.shape)
            out = torch.stack([e(local[:, i]) for i, e in enumerate(self.deepspeed_moe.experts.deepspeed_experts)], 1)
            out = out.reshape(-1, *x.shape)
            if self.ep_size > 1:
                out = _A2A.apply(self.group, out)
            y = (mask * out).sum(0) * probs.gather(1, index[:, None])
            return y.reshape(shape), torch.zeros(()), None

    hidden = cfg["hidden"]

    def expert():
        return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    layer_kind = "deepspeed.moe.layer.MoE"

    def moe():
        nonlocal layer_kind
        try:
            from deepspeed.moe.layer import MoE

            return MoE(hidden, expert(), num_experts=cfg["experts"], ep_size=ep, k=1, capacity_factor=1.0,
                       min_capacity=4)
        except Exception as exc:   # ours before deepspeed.moe.layer.MoE lands: NotSupportedYet
            layer_kind = f"bench Top1MoE ({type(exc).__name__})"
            return Top1MoE(hidden, expert, cfg["experts"], ep)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.attn = nn.MultiheadAttention(hidden, 4, batch_first=True)
            self.moe = moe()

        def forward(self, x):
            h = self.ln1(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            out, l_aux, _ = self.moe(self.ln2(x))
            return x + out, l_aux

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(cfg["vocab"], hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.head = nn.Linear(hidden, cfg["vocab"])

        def forward(self, ids):
            x, aux = self.emb(ids[:, :-1]), 0.0
            for block in self.blocks:
                x, l_aux = block(x)
                aux = aux + l_aux
            logits = self.head(x)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1)) + 0.01 * aux

    torch.manual_seed(0)
    model = GPT()
    return model, layer_kind


def _rank(rank: int, world: int, port: int, ep: int, cfg: dict, out: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    a2a = {"bytes": 0}
    original = tdist.all_to_all_single

    groups._create_expert_and_data_parallel(ep)
    ep_group = groups._get_expert_parallel_group(f"ep_size_{ep}")

    def counted(output, input, *args, **kwargs):   # the MoE layers' exchanges only (gloo reduce-scatters use it too)
        group = args[2] if len(args) > 2 else kwargs.get("group")
        if ep > 1 and group is ep_group:
            a2a["bytes"] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    tdist.all_to_all_single = counted
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep}")
    model, layer_kind = _model(cfg, ep, ep_rank)
    micro = cfg["batch"] // world
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": cfg["stage"]}, "steps_per_print": 10**9}
    params = list(model.parameters())
    try:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "all"})
    except ImportError:
        pass
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
               for _ in range(cfg["warmup"] + cfg["steps"])]
    expert_params = [p for p in engine.module.parameters() if getattr(p, "allreduce", True) is False]
    row = {"rank": rank, "layer": layer_kind, "expert_params": tensor_bytes(expert_params),
           "params": tensor_bytes(engine.module.parameters()), "losses": [], "wall": [], "cpu": [], "a2a": []}
    for step, ids in enumerate(batches):
        x = ids[rank * micro:(rank + 1) * micro]
        dist.barrier()
        a2a["bytes"] = 0
        wall, cpu = time.perf_counter(), time.process_time()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        row["losses"].append(float(loss.detach()))
        if step == 0:
            row["optimizer"] = optimizer_state_bytes(optimizer)
        if step >= cfg["warmup"]:
            row["wall"].append(wall)
            row["cpu"].append(cpu)
            row["a2a"].append(a2a["bytes"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm leaves these
        os.unlink(path)
    if rank == 0:
        queue.put("done")


def child(args) -> None:
    cfg = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq, batch=args.batch,
               experts=args.experts, steps=args.steps, warmup=args.warmup, stage=args.stage)
    run_case_and_report(_rank, args.ranks, args.child_ep, cfg, timeout=args.job_timeout)


def launch(args, impl: str, ep: int) -> dict:
    argv = ["--child-ep", str(ep), "--ranks", str(args.ranks)]
    for key in ("hidden", "layers", "vocab", "seq", "batch", "experts", "steps", "warmup", "stage", "job_timeout"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return run_child(impl, __file__, argv, args.ds_venv, args.job_timeout)


def kib(b: float) -> str:
    return f"{b / 2**10:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage (0, 1 or 2)")
    add_impl_args(p)
    p.add_argument("--child-ep", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_ep:
        child(args)
        return 0
    impls = chosen_impls(args)
    eps = [int(e) for e in args.eps.split(",")]
    print(f"MoE GPT: hidden {args.hidden}, {args.layers} layers x {args.experts} experts (MLP 4x), vocab "
          f"{args.vocab}, seq {args.seq}, global batch {args.batch} ({args.batch * args.seq} tokens); ZeRO-{args.stage} fp32 "
          f"Adam; {args.ranks} ranks x 1 thread, gloo; steps {args.warmup + 1}-{args.warmup + args.steps} timed")
    print("| impl | layer | ep | expert params / rank (KiB) | params / rank (KiB) | optimizer state / rank (KiB) "
          "| all-to-all sent / rank / step (KiB) | tokens/s | CPU s/step (rank max) | first losses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for impl in impls:
        for ep in eps:
            r = launch(args, impl, ep)
            name = "ours" if impl == "ours" else "DeepSpeed 0.19.8"
            if "ranks" not in r:
                print(f"| {name} | | {ep} | error: {r['error'][:500]} |||||||")
                continue
            ranks = r["ranks"]
            r0 = ranks[0]
            wall = statistics.median(max(w) for w in zip(*(rk["wall"] for rk in ranks)))
            cpu = statistics.median(max(c) for c in zip(*(rk["cpu"] for rk in ranks)))
            a2a = statistics.median(max(a) for a in zip(*(rk["a2a"] for rk in ranks)))
            losses = [statistics.fmean(x) for x in zip(*(rk["losses"] for rk in ranks))]
            print(f"| {name} | {r0['layer']} | {ep} | {kib(r0['expert_params'])} | {kib(r0['params'])} | "
                  f"{kib(r0['optimizer'])} | {kib(a2a)} | {args.batch * args.seq / wall:.0f} | {cpu:.3f} | "
                  f"{', '.join(f'{x:.4f}' for x in losses[:3])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
