"""One 2-rank CPU job of the universal-checkpoint interop check (tools/universal_interop/run.py), written
against the public DeepSpeed API only, so the same file runs with this package or with DeepSpeed 0.19.8.

    python worker.py '<json spec>'   # prints RESULT <json> (rank 0)

spec: ckpt (directory), tp (autotp_size), stage, steps, start (first batch index), optimizer ("adamw" or
"sgd": momentum 0.9), load (null, "plain" or "universal"), save (a tag or null). The model is a small LM
whose fused [gate; up] weight is split block by block (partition_config), down row-parallel; the global
batch is 2 rows at every layout (micro = tp)."""

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
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h):
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.block = Glu()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.block(self.norm(h))
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), ids.roll(-1, dims=1).reshape(-1))


def rank_main(rank: int, spec: dict, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2")
    import deepspeed
    import torch.distributed as tdist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = TinyLM()
    if spec["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    tp = spec["tp"]
    config = {"train_micro_batch_size_per_gpu": tp, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": spec["stage"]}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True}   # DeepSpeed's ZeRO refuses torch SGD without it
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp, **SPECS}
    if spec.get("load") == "universal":
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if spec.get("load"):
        engine.load_checkpoint(spec["ckpt"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(spec["start"] + spec["steps"])]
    dp_rank = rank // tp
    losses = []
    for ids in batches[spec["start"]:]:
        loss = engine(ids[dp_rank * tp:(dp_rank + 1) * tp])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(float(mean) / 2)
    if spec.get("save"):
        engine.save_checkpoint(spec["ckpt"], tag=spec["save"])
    sums = {n: float(p.detach().double().sum()) for n, p in engine.module.named_parameters()} if tp == 1 else {}
    if rank == 0:
        queue.put({"losses": losses, "param_sums": sums, "deepspeed": deepspeed.__version__})
    tdist.barrier()


def main() -> None:
    spec = json.loads(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, spec, port, queue)) for r in range(2)]
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
