"""One 2-rank CPU job of the AutoEP universal-checkpoint interop check (tools/universal_interop/autoep.py),
written against the public DeepSpeed API only, so the same file runs with this package or DeepSpeed 0.19.8.

    python autoep_worker.py '<json spec>'   # prints RESULT <json> (rank 0)

spec: ckpt (directory), ep (autoep_size), stage, steps, start (first batch index), load (null, "universal", or
"plain": load_checkpoint with strict defaults),
save (a tag or null). The model is the AutoEP ZeRO-3 fixture's (tests/fixtures/ds_0_19_8_autoep_zero3/
autoep_model.py: Mixtral-style blocks both builds replace whole, `router.gate`, `experts.w1/w2/w3`), torch Adam
with clipping; each rank trains on its own batches (2 data ranks at every ep size)."""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "fixtures", "ds_0_19_8_autoep_zero3"))
sys.path.insert(0, HERE)

from worker import spawn  # noqa: E402


def rank_main(rank: int, spec: dict, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2")
    import autoep_model
    import deepspeed
    import torch.distributed as tdist

    deepspeed.init_distributed(dist_backend="gloo")
    config = autoep_model.config(spec["ep"])
    config["zero_optimization"] = {"stage": spec["stage"]}
    if spec.get("load") == "universal":
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=autoep_model.Model(), config=config)
    if spec.get("load"):
        engine.load_checkpoint(spec["ckpt"], tag=spec.get("tag"))
    losses = []
    for step in range(spec["start"], spec["start"] + spec["steps"]):
        loss = engine(autoep_model.batch(step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(float(mean) / 2)
    if spec.get("save"):
        engine.save_checkpoint(spec["ckpt"], tag=spec["save"])
    if rank == 0:
        queue.put({"losses": losses, "deepspeed": deepspeed.__version__})
    tdist.barrier()


if __name__ == "__main__":
    spawn(rank_main, json.loads(sys.argv[1]))
