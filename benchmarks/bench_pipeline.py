"""Pipeline parallelism: step time of our PipelineEngine, DeepSpeed 0.19.8's, and
torch.distributed.pipelining's Schedule1F1B on one GPT-style model and batch (gloo, CPU).

    python benchmarks/bench_pipeline.py --repeats 3           # all configurations, side by side
    python benchmarks/bench_pipeline.py --impl ours --stages 2 --world 2   # one run, JSON line

Upstream runs under its own interpreter (`--upstream-python`, default /tmp/ds-venv/bin/python;
see BENCHMARKS.md for the venv); our package is found through PYTHONPATH. The bubble fraction
is measured as 1 - (this stage's forward+backward compute time) / (step time), averaged over
stages, and printed beside the 1F1B formula (p - 1) / (m + p - 1). "step / 1F1B bound" divides the step
by (m + p - 1) / m times the busiest stage's compute: what any 1F1B run of the same stages needs at
least (1.00 = no communication or scheduling cost at all).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MICRO = 512, 128, 4, 8, 64, 4
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_layers(torch):
    from torch import nn

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Parameter(torch.zeros(SEQ, HIDDEN))

        def forward(self, ids):
            return self.tok(ids) + self.pos

    class Block(nn.TransformerEncoderLayer):
        def __init__(self):
            super().__init__(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0, batch_first=True, norm_first=True)

        def forward(self, x):
            return super().forward(x, is_causal=False)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(HIDDEN)
            self.out = nn.Linear(HIDDEN, VOCAB)

        def forward(self, x):
            return self.out(self.norm(x))

    return Embed, Block, Head


def loss_fn(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def worker(rank, world, port, impl, stages, micro_batches, steps, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    Embed, Block, Head = build_layers(torch)
    dp = world // stages
    batches = [(torch.randint(0, VOCAB, (MICRO, SEQ)), torch.randint(0, VOCAB, (MICRO, SEQ)))
               for _ in range(micro_batches)]
    busy = [0.0]
    if impl == "torch":
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        dist.init_process_group("gloo")
        layers = [Embed()] + [Block() for _ in range(LAYERS)] + [Head()]
        per = len(layers) // stages
        bounds = [i * per for i in range(stages)] + [len(layers)]
        stage_mod = torch.nn.Sequential(*layers[bounds[rank]:bounds[rank + 1]])
        timed(stage_mod, busy)
        stage = PipelineStage(stage_mod, rank, stages, torch.device("cpu"))
        sched = Schedule1F1B(stage, micro_batches, loss_fn=loss_fn)
        opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-4)
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])

        def step():
            opt.zero_grad()
            if rank == 0:
                sched.step(ids)
            elif rank == stages - 1:
                sched.step(target=labels)
            else:
                sched.step()
            opt.step()
    else:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
        specs = [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(LAYERS)] + [LayerSpec(Head)]
        model = PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
               "train_batch_size": MICRO * micro_batches * dp, "steps_per_print": 10 ** 9,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1 if dp > 1 else 0}}
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        for layer in engine.module.forward_funcs:
            timed(layer, busy)
        instr = time_instructions(type(engine))

        def step():
            engine.train_batch(iter(batches))
    times, per_instr = [], []
    for i in range(steps + 2):
        busy[0] = 0.0
        if impl != "torch":
            instr.clear()
        start = time.perf_counter()
        step()
        if i >= 2:
            times.append((time.perf_counter() - start, busy[0]))
            if impl != "torch":
                per_instr.append(dict(instr))
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    instr_gathered = [None] * world
    dist.all_gather_object(instr_gathered, per_instr)
    if rank == 0:
        step_s = statistics.median(max(t[i][0] for t in gathered) for i in range(steps))
        bubble = statistics.mean(1 - statistics.median(t[i][1] for i in range(steps)) / step_s for t in gathered)
        # No 1F1B run can beat (m + p - 1) micro-batch slots of the slowest stage's compute.
        busiest = max(statistics.median(t[i][1] for i in range(steps)) for t in gathered)
        bound = busiest * (micro_batches + stages - 1) / micro_batches
        with open(out, "w") as f:
            # Per rank, the median over steps of the time in each schedule instruction (ours, upstream).
            instr_s = [{name: statistics.median(s.get(name, 0.0) for s in steps_of_rank)
                        for name in sorted({n for s in steps_of_rank for n in s})}
                       for steps_of_rank in instr_gathered] if impl != "torch" else None
            json.dump({"impl": impl, "stages": stages, "world": world, "micro_batches": micro_batches,
                       "step_s": step_s, "bubble": bubble, "bound_s": bound, "instr_s": instr_s}, f)
    dist.barrier()
    dist.destroy_process_group()


def time_instructions(engine_class):
    """Time every schedule instruction the engine executes; returns {instruction: seconds this
    step}. Ours and upstream's PipelineEngine both dispatch through `_INSTRUCTION_MAP`."""
    spent = {}
    table = engine_class._INSTRUCTION_MAP
    for cls, handler in list(table.items()):
        def timed_handler(self, *args, _handler=handler, _name=cls.__name__, **kwargs):
            start = time.perf_counter()
            try:
                return _handler(self, *args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start
        table[cls] = timed_handler
    return spent


def timed(module, busy):
    """Add the forward and backward compute time of `module` into busy[0]."""
    import torch

    state = {}

    def pre(mod, args):
        state["t"] = time.perf_counter()

    def post(mod, args, output):
        busy[0] += time.perf_counter() - state["t"]

    def bpre(mod, grad_output):
        state["b"] = time.perf_counter()

    def bpost(mod, grad_input, grad_output):
        busy[0] += time.perf_counter() - state.get("b", time.perf_counter())

    if isinstance(module, torch.nn.Module):
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        module.register_full_backward_pre_hook(bpre)
        module.register_full_backward_hook(bpost)


def run_one(args):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/bench_pipe_{os.getpid()}.json"
    mp.spawn(worker, args=(args.world, port, args.impl, args.stages, args.micro_batches, args.steps, out),
             nprocs=args.world, join=True)
    with open(out) as f:
        print(json.dumps(json.load(f)))
    os.remove(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "upstream", "torch"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--upstream-python", default="/tmp/ds-venv/bin/python")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all configurations, order rotated")
    args = parser.parse_args()
    if args.impl:
        return run_one(args)
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for stages, world in ((2, 2), (4, 4), (2, 4)):
            impls = ["ours", "upstream", "torch"]
            impls = impls[repeat % 3:] + impls[:repeat % 3]   # rotate the order: no impl always runs first
            for impl in impls:
                if impl == "torch" and world != stages:
                    continue   # torch.distributed.pipelining has no data parallelism of its own
                row = run_subprocess(args, impl, stages, world)
                if row is not None:
                    runs.setdefault((stages, world, impl), []).append(row)
    m = args.micro_batches
    print(f"{args.repeats} repeat(s) of {args.steps} steps each; step = median over repeats (range)")
    print("| layout (stages x dp) | impl | step (s) | range (s) | vs upstream | step / 1F1B bound | bubble measured "
          "| 1F1B formula |")
    print("|---|---|---|---|---|---|---|---|")
    for (p, world, impl), rows in runs.items():
        step = statistics.median(r["step_s"] for r in rows)
        base_rows = runs.get((p, world, "upstream"))
        ratio = f"{step / statistics.median(r['step_s'] for r in base_rows):.2f}x" if base_rows else "-"
        low, high = min(r["step_s"] for r in rows), max(r["step_s"] for r in rows)
        bubble = statistics.median(r["bubble"] for r in rows)
        over_bound = statistics.median(r["step_s"] / r["bound_s"] for r in rows)
        print(f"| {p} x {world // p} | {impl} | {step:.3f} | {low:.3f}-{high:.3f} | {ratio} | {over_bound:.2f} | "
              f"{bubble:.2f} | {(p - 1) / (m + p - 1):.2f} |")
    print_breakdown(runs)


_GROUPS = {"compute (F+B)": ("ForwardPass", "BackwardPass"), "recv wait": ("RecvActivation", "RecvGrad"),
           "send": ("SendActivation", "SendGrad"), "reduce": ("ReduceGrads", "ReduceTiedGrads"),
           "optimizer step": ("OptimizerStep",), "load": ("LoadMicroBatch",)}


def print_breakdown(runs):
    """Where each engine's step goes, per schedule instruction (ours and upstream). "floor" is
    the busiest stage's compute alone: a step with no bubble and free communication; divided by
    upstream's step it is the least ratio any schedule of these stages could reach."""
    print("\nPer instruction, ms per step (busiest stage's compute; the rest averaged over ranks):")
    print("| layout | impl | step | " + " | ".join(_GROUPS) + " | floor / upstream step |")
    print("|---|---|---|" + "---|" * len(_GROUPS) + "---|")
    for (p, world, impl), rows in runs.items():
        rows = [r for r in rows if r.get("instr_s")]
        base = runs.get((p, world, "upstream"))
        if not rows or not base:
            continue
        cells, floors = [], []
        for name, members in _GROUPS.items():
            per_run = []
            for r in rows:
                per_rank = [sum(ranks.get(k, 0.0) for k in members) for ranks in r["instr_s"]]
                per_run.append(max(per_rank) if name == "compute (F+B)" else statistics.mean(per_rank))
                if name == "compute (F+B)":
                    floors.append(max(per_rank))
            cells.append(f"{statistics.median(per_run) * 1e3:.0f}")
        upstream_step = statistics.median(r["step_s"] for r in base)
        step = statistics.median(r["step_s"] for r in rows)
        print(f"| {p} x {world // p} | {impl} | {step * 1e3:.0f} | " + " | ".join(cells) +
              f" | {statistics.median(floors) / upstream_step:.2f} |")


def run_subprocess(args, impl, stages, world):
    """One configuration in a fresh interpreter (upstream's from its own venv); its JSON row."""
    python = args.upstream_python if impl == "upstream" else sys.executable
    env = dict(os.environ, TORCH_EXTENSIONS_DIR="/tmp/ds-ext-bench")
    if impl == "upstream":
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = ROOT
    cmd = [python, os.path.abspath(__file__), "--impl", impl, "--stages", str(stages), "--world", str(world),
           "--micro-batches", str(args.micro_batches), "--steps", str(args.steps)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
    for f in os.listdir("/dev/shm"):
        if f.startswith("deepspeed_allreduce_buffer_"):   # upstream's runs leave these behind
            os.remove(os.path.join("/dev/shm", f))
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    if result.returncode != 0 or not line:
        print(f"{impl} {stages}x{world // stages}: failed\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[-1])


if __name__ == "__main__":
    main()
