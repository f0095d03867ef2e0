"""Muon vs AdamW under ZeRO-1 and ZeRO-3 at 2 ranks (gloo, CPU): step time, optimizer-state
bytes per rank (counted from the base optimizer's state tensors) and bytes each rank sends per
step (deepspeed.comm's counter; Muon's two all-to-alls also shown apart).

    python benchmarks/bench_muon.py [--steps 12] [--dim 256] [--layers 4] [--repeats 3]
    python benchmarks/bench_muon.py --impls ours,ds [--ds-venv /tmp/ds-venv]   # side by side with DeepSpeed 0.19.8

Side by side, each implementation runs in its own interpreter (_ds_child.run_child); the bytes there are
what each rank puts on the wire per step with a ring: for DeepSpeed counted by wrapping torch.distributed's
collectives in the rank, for ours by deepspeed.comm's counter (the same ring formula; ours' ZeRO-3 gathers
call the ProcessGroup directly, past torch.distributed's module functions).

Cases run round-robin `repeats` times (the machine is shared: interleaving spreads its load over
all of them); the table gives the median of the per-run medians and their range.

The model: an embedding and an LM head (AdamW under "Muon", by upstream's name rule) around
`layers` MLP blocks of two dim x 4dim matrices (Muon) with biases and a LayerNorm (AdamW).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_child import add_impl_args, chosen_impls, optimizer_state_bytes, run_case_and_report, run_child  # noqa: E402
from _ranks import run_ranks  # noqa: E402

VOCAB, SEQ, BATCH = 1024, 16, 8


def _model(dim: int, layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, h):
            return h + self.down(torch.relu(self.up(self.norm(h))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.lm_head = nn.Linear(dim, VOCAB)

        def forward(self, x, y):
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    return Net()


def _rank(rank: int, world: int, port: int, cases: list, steps: int, dim: int, layers: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rows = []
    for name, optimizer, stage in cases:
        config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": optimizer,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
        engine, opt, _, _ = deepspeed.initialize(model=_model(dim, layers), config=config)
        g = torch.Generator().manual_seed(rank)
        times, sent, a2a = [], [], []
        for step in range(steps):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            dist.comms_counter.reset()
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            times.append(time.perf_counter() - start)
            summary = dist.comms_counter.summary()
            # what this rank puts on the wire: the counter's wire_bytes for the collectives of
            # equal splits; Muon's all-to-all never sends to its own rank, so all its input goes
            a2a.append(summary.get("all_to_all_single", {}).get("bytes", 0))
            sent.append(sum(s["wire_bytes"] for op, s in summary.items()
                            if op not in ("barrier", "all_to_all_single")) + a2a[-1])
        state = sum(t.numel() * t.element_size() for s in opt.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        muon = sum(p.numel() for p in engine.module.parameters() if getattr(p, "use_muon", False))
        row = {"case": name, "stage": stage, "step_s": statistics.median(times[2:]), "state": state,
               "sent": statistics.median(sent[2:]), "a2a": statistics.median(a2a[2:]), "muon_numel": muon,
               "numel": sum(p.numel() for p in engine.module.parameters())}
        everyone = [None] * world
        dist.all_gather_object(everyone, row)
        rows.append(everyone)
        del engine, opt
    if rank == 0:
        queue.put(rows)


_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast",
                "all_gather", "reduce_scatter", "_reduce_scatter_base", "_all_gather_base", "reduce")


def _count_torch_distributed(tdist, counter: dict, world: int) -> None:
    """Wrap torch.distributed's collectives: add what one rank puts on the wire with a bandwidth-optimal
    ring to counter["bytes"] (2(N-1)/N of the message for all_reduce, (N-1)/N for the others; the message
    is the full logical tensor: an all-gather's output, a reduce-scatter's input)."""
    ring = (world - 1) / world

    def wrap(name, original):
        def counted(*args, **kwargs):
            values = list(args) + list(kwargs.values())
            tensors = [a for a in values if hasattr(a, "element_size")]
            lists = [list(a) for a in values if isinstance(a, (list, tuple)) and a and hasattr(a[0], "element_size")]
            if lists:   # all_gather(list, tensor) / reduce_scatter(tensor, list): the list is the message
                message = lists[0]
            elif name in ("all_reduce", "broadcast", "reduce") or len(tensors) < 2:
                message = tensors[:1]
            else:   # (output, input): an all-gather's output, a reduce-scatter's or all-to-all's input
                message = [tensors[0] if "gather" in name else tensors[1]]
            nbytes = sum(t.numel() * t.element_size() for t in message)
            counter["bytes"] += nbytes * (2 * ring if name == "all_reduce" else ring)
            return original(*args, **kwargs)
        return counted

    for name in _COLLECTIVES:
        if hasattr(tdist, name):
            setattr(tdist, name, wrap(name, getattr(tdist, name)))


def _side_rank(rank: int, world: int, port: int, cases: list, steps: int, dim: int, layers: int, out: str,
               queue) -> None:
    """One rank of the side-by-side run (ours or DeepSpeed 0.19.8, whichever `import deepspeed` finds)."""
    import glob
    import json

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    counter = {"bytes": 0}
    _count_torch_distributed(tdist, counter, world)
    rows = []
    for name, optimizer, stage, *extra in cases:
        config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": optimizer,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, **(extra[0] if extra else {})}
        row = {"case": name, "stage": stage, "wall": [], "cpu": [], "bytes": [], "losses": []}
        try:
            engine, opt, _, _ = deepspeed.initialize(model=_model(dim, layers), config=config)
            g = torch.Generator().manual_seed(rank)
            for step in range(steps):
                x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                dist.barrier()
                counter["bytes"] = 0
                if hasattr(dist, "comms_counter"):
                    dist.comms_counter.reset()
                wall, cpu = time.perf_counter(), time.process_time()
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
                row["wall"].append(time.perf_counter() - wall)
                row["cpu"].append(time.process_time() - cpu)
                if hasattr(dist, "comms_counter"):   # ours: its ZeRO-3 gathers call the ProcessGroup, past the wrapper
                    row["bytes"].append(sum(s["wire_bytes"] for op, s in dist.comms_counter.summary().items()
                                            if op != "barrier"))
                else:
                    row["bytes"].append(counter["bytes"])
                row["losses"].append(float(loss.detach()))
                norm = engine.get_global_grad_norm()   # the norm gradient_clipping compared with the threshold
                row.setdefault("norms", []).append(None if norm is None else float(norm))
            row["state"] = optimizer_state_bytes(opt)
            del engine, opt
        except Exception as exc:   # an unsupported case is a row, not the end of the run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm leaves these
        os.unlink(path)
    if rank == 0:
        queue.put("done")


def _side_by_side(args, cases: list) -> None:
    import json

    impls = chosen_impls(args)
    names = {"ours": "ours", "ds": "DeepSpeed 0.19.8"}
    print(f"2 ranks x 1 thread, gloo; medians of steps 3-{args.steps}; bytes = ring wire bytes of every "
          "torch.distributed collective per rank per step")
    print("| impl | optimizer | ZeRO stage | wall s/step | CPU s/step (rank max) | optimizer state / rank (bytes) "
          "| sent / rank / step (bytes) | losses (steps 1, 2, last) | reported grad norm (step 1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for impl in impls:
        argv = ["--child", json.dumps(cases), "--steps", str(args.steps), "--dim", str(args.dim),
                "--layers", str(args.layers), "--job-timeout", str(args.job_timeout)]   # the ranks' limit too
        result = run_child(impl, __file__, argv, args.ds_venv, args.job_timeout)
        if "error" in result:
            print(f"| {names[impl]} | error: {result['error'][:300]} ||||||||")
            continue
        for i, (name, _, stage, *_extra) in enumerate(cases):
            per_rank = [ranks[i] for ranks in result["ranks"]]
            r0 = per_rank[0]
            if "error" in r0:
                print(f"| {names[impl]} | {name} | {stage} | error: `{r0['error']}` ||||||")
                continue
            cpu = max(statistics.median(r["cpu"][2:]) for r in per_rank)
            losses = ", ".join(f"{v:.4f}" for v in (r0["losses"][0], r0["losses"][1], r0["losses"][-1]))
            norm = r0.get("norms", [None])[0]
            norm = "-" if norm is None else f"{norm:.4f}"
            print(f"| {names[impl]} | {name} | {stage} | {statistics.median(r0['wall'][2:]):.4f} | {cpu:.4f} | "
                  f"{r0['state']:,} | {statistics.median(r0['bytes'][2:]):,.0f} | {losses} | {norm} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", default="1,3")
    add_impl_args(parser)
    parser.set_defaults(impls="")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:   # in the interpreter run_child started: ours or DeepSpeed's
        cases = [tuple(c) for c in __import__("json").loads(args.child)]
        run_case_and_report(_side_rank, 2, cases, args.steps, args.dim, args.layers, timeout=args.job_timeout)
        return
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}
    if args.impls:
        cases = []
        for stage in (int(s) for s in args.stages.split(",")):
            cases.append(("AdamW", adamw, stage))
            muon = {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02}}
            cases.append(("Muon", muon, stage))
            # DeepSpeed 0.19.8 at ZeRO 1-3 clips the orthogonalised Muon update, not the gradient
            # ([Note: Muon and gradient clipping]); with clipping off both run the same formula
            cases.append(("Muon, gradient_clipping 0", muon, stage, {"gradient_clipping": 0.0}))
        _side_by_side(args, cases)
        return
    cases = []
    for stage in (int(s) for s in args.stages.split(",")):
        cases.append(("AdamW", adamw, stage))
        for method in ("standard", "gram"):
            cases.append((f"Muon ({method})",
                          {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "ns_method": method}}, stage))
    runs = run_ranks(_rank, 2, cases * args.repeats, args.steps, args.dim, args.layers)
    first = max((ranks[0] for ranks in runs), key=lambda r: r["muon_numel"])
    print(f"model: {first['numel']:,} parameters, {first['muon_numel']:,} in Muon matrices; 2 ranks x 1 thread, "
          f"median of steps 3-{args.steps}")
    print("| optimizer | ZeRO stage | median step (s), rank 0 | repeat medians (s) | optimizer state / rank "
          "(bytes), rank 0 / 1 | sent / step / rank (bytes) | of which Muon all-to-all |")
    print("|---|---|---|---|---|---|---|")
    for i in range(len(cases)):
        same = runs[i::len(cases)]
        r0, r1 = same[0]
        medians = sorted(ranks[0]["step_s"] for ranks in same)
        print(f"| {r0['case']} | {r0['stage']} | {statistics.median(medians):.4f} | "
              f"{medians[0]:.4f}-{medians[-1]:.4f} | {r0['state']:,} / {r1['state']:,} | "
              f"{r0['sent']:,.0f} / {r1['sent']:,.0f} | {r0['a2a']:,.0f} / {r1['a2a']:,.0f} |")

if __name__ == "__main__":
    main()
