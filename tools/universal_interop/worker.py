"""One 2-rank CPU job of the universal-checkpoint interop check (tools/universal_interop/run.py), written
against the public DeepSpeed API only, so the same file runs with this package or with DeepSpeed 0.19.8.

    python worker.py '<json spec>'   # prints RESULT <json> (rank 0)

spec: ckpt (directory), tp (autotp_size), stage, steps, start (first batch index), optimizer ("adamw" or
"sgd": momentum 0.9), load (null, "plain" or "universal"), save (a tag or null); for
benchmarks/bench_checkpoint_layouts.py also world (ranks, default 2), hidden / vocab / blocks (the model's
size, default a tiny one), tag (the tag to load) and measure (the load's slowest-rank wall and CPU
seconds and peak RSS growth). The model is a small LM whose fused [gate; up] weight is split block by
block (partition_config), down row-parallel; the global batch is 2 rows at every layout (micro = tp)."""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp
from torch import nn

VOCAB, HIDDEN, SEQ = 32, 16, 6
SPECS = {"partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*gate_up\.weight$"], "partition_type": "column", "shape": [2, -1]},
    {"patterns": [r".*down\.weight$"], "partition_type": "row"}]}}


class Glu(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, h):
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, hidden: int = HIDDEN, vocab: int = VOCAB, blocks: int = 1) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.block = Glu(hidden)
        self.more = nn.ModuleList(Glu(hidden) for _ in range(blocks - 1))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in [self.block, *self.more]:
            h = h + block(self.norm(h))
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, self.vocab), ids.roll(-1, dims=1).reshape(-1))


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _measured_load(engine, spec: dict) -> list[float]:
    """[wall s, CPU s, peak RSS growth MiB] of load_checkpoint on this rank (the peak counter reset first)."""
    import time

    import torch.distributed as tdist

    tdist.barrier()
    with open("/proc/self/clear_refs", "w") as f:   # resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")
    rss0, wall0, cpu0 = _memory_kib("VmRSS"), time.perf_counter(), time.process_time()
    engine.load_checkpoint(spec["ckpt"], tag=spec.get("tag"))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return [wall, cpu, (_memory_kib("VmHWM") - rss0) / 1024]


def rank_main(rank: int, spec: dict, port: int, queue) -> None:
    world = spec.get("world", 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    import deepspeed
    import torch.distributed as tdist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = TinyLM(spec.get("hidden", HIDDEN), spec.get("vocab", VOCAB), spec.get("blocks", 1))
    if spec["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    tp = spec["tp"]
    config = {"train_micro_batch_size_per_gpu": tp * 2 // world, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6,
              "zero_optimization": {"stage": spec["stage"]}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True}   # DeepSpeed's ZeRO refuses torch SGD without it
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp, **SPECS}
    if spec.get("load") == "universal":
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    cost = None
    if spec.get("load") and spec.get("measure"):
        cost = torch.tensor(_measured_load(engine, spec), dtype=torch.float64)
        tdist.all_reduce(cost, op=tdist.ReduceOp.MAX)
    elif spec.get("load"):
        engine.load_checkpoint(spec["ckpt"], tag=spec.get("tag"))
    g = torch.Generator().manual_seed(0)
    vocab = spec.get("vocab", VOCAB)
    batches = [torch.randint(0, vocab, (2, SEQ), generator=g) for _ in range(spec["start"] + spec["steps"])]
    micro = tp * 2 // world
    dp_rank = rank // tp
    losses = []
    for ids in batches[spec["start"]:]:
        loss = engine(ids[dp_rank * micro:(dp_rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(float(mean) / world)
    if spec.get("save"):   # without TP, DeepSpeed's ds_to_universal wants the client's (empty) universal info
        client = {"universal_checkpoint_info": {}} if tp == 1 else {}
        engine.save_checkpoint(spec["ckpt"], tag=spec["save"], client_state=client)
    sums = {n: float(p.detach().double().sum()) for n, p in engine.module.named_parameters()} if tp == 1 else {}
    if rank == 0:
        queue.put({"losses": losses, "param_sums": sums, "deepspeed": deepspeed.__version__,
                   **({"load_cost": cost.tolist()} if cost is not None else {})})
    tdist.barrier()


def main() -> None:
    spawn(rank_main, json.loads(sys.argv[1]))


def spawn(target, spec: dict) -> None:
    """Run `target(rank, spec, port, queue)` on spec["world"] (2) processes; print rank 0's RESULT line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, spec, port, queue)) for r in range(spec.get("world", 2))]
    for p in procs:
        p.start()
    import queue as queues

    result = None
    while result is None:   # a rank that fails leaves the other waiting in a collective: stop both
        try:
            result = queue.get(timeout=1)
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(1)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
