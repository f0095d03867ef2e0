"""A 2-rank training loop in which rank 1 diverges once, in one of the ways a program can.

    diverge.py --stage {0,1,2,3} --case {none,skip_backward,extra_backward,skip_step,micro_batches}

At step 2: `skip_backward` (rank 1 skips engine.backward for its first micro-batch),
`extra_backward` (rank 1 runs one more forward+backward), `skip_step` (rank 1 skips
engine.step for the whole step), `micro_batches` (rank 1 runs 3 micro-batches instead of 2).
Rank 0 prints `DONE` when its loop ends. Started through the `deepspeed` launcher by
tests/distributed/test_comm_guard.py with a short DEEPSPEED_COMM_GUARD_S.
"""

import argparse

import torch

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="none")
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0, "steps_per_print": 1000}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
odd = deepspeed.comm.get_rank() == 1
for step in range(4):
    here = odd and step == 2
    for micro in range(3 if here and args.case == "micro_batches" else 2):
        x, y = torch.randn(2, 8), torch.randn(2, 1)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        if not (here and micro == 0 and args.case == "skip_backward"):
            engine.backward(loss)
        if here and micro == 0 and args.case == "extra_backward":
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if not (here and args.case == "skip_step"):
            engine.step()
print(f"DONE rank {deepspeed.comm.get_rank()}", flush=True)
