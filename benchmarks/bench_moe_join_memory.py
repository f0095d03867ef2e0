"""Memory of joining an EP x TP (MoE-layout) checkpoint (issue 39 item 1): `ds_to_universal` of the tag, and a
plain `load_checkpoint` of it at another expert-parallel size (moe_io.moe_reader: the tag read joined, as its
universal form), before and after the join became per parameter (checkpoint/moe_join.py).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_moe_join_memory.py [--hidden 512]

An HF Mixtral (2 layers, hidden 512, 8 experts of intermediate 1024, vocab 256: 26.2M parameters, ~315 MB of
fp32 masters and Adam moments) under AutoEP x AutoTP, tp 2 x ep 2 on 4 gloo ranks, ZeRO-1, one step, saved.
(a) `python -m deepspeed.checkpoint.ds_to_universal` of the tag in a child process: its peak anonymous RSS rise
(deepspeed/utils/rss_peak.py) and its peak RSS (ru_maxrss: memory-mapped file pages too). (b) a fresh engine at
tp 2 x ep 4 (the same 4 ranks) loads the tag: each rank's peak anonymous RSS rise over load_checkpoint, measured
after `malloc_trim` (as bench_moe_load_memory.py), and how many joins it made (moe_join.MoEIndex.join, counted)
for how many distinct (parameter, field) pairs; (c) the same at the saving layout (no join: what the rank's
own state costs the load, the floor of (b)). The largest parameter's field is printed for scale.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))

_CONVERT = """
import resource, sys
from deepspeed.utils.rss_peak import peak_anon_rise
from deepspeed.checkpoint.ds_to_universal import convert
count, rise = peak_anon_rise(lambda: convert(sys.argv[1], sys.argv[2]))
print("RESULT", count, rise, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _mixtral(hidden: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64, output_router_logits=False)
    return MixtralForCausalLM(config)


def _engine(hidden: int, ep: int):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "tensor_parallel": {"autotp_size": 2},
              "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}}
    return deepspeed.initialize(model=_mixtral(hidden), config=config)[0]


def save_job(hidden: int, save_dir: str) -> int:
    engine = _engine(hidden, 2)
    ids = torch.randint(0, 256, (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    return sum(p.numel() for p in engine.module.parameters())


def load_job(hidden: int, save_dir: str, ep: int) -> tuple[int, int, int]:
    """(peak anonymous RSS rise of the load, joins made, distinct (parameter, field) pairs joined)."""
    from deepspeed.checkpoint import moe_join
    from deepspeed.utils.rss_peak import peak_anon_rise

    joins: list = []
    join = moe_join.MoEIndex.join
    moe_join.MoEIndex.join = lambda index, name, field: joins.append((name, field)) or join(index, name, field)
    engine = _engine(hidden, ep)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        rise = peak_anon_rise(lambda: engine.load_checkpoint(save_dir, tag="t"))[1]
    finally:
        moe_join.MoEIndex.join = join
    return rise, len(joins), len(set(joins))


def main() -> None:
    from harness import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        ckpt = os.path.join(work, "ckpt")
        run_distributed(4, save_job, args.hidden, ckpt, timeout=900)
        tag = os.path.join(ckpt, "t")
        optim = sum(os.path.getsize(os.path.join(tag, f)) for f in os.listdir(tag) if f.endswith("optim_states.pt"))
        biggest = 8 * 2 * (2 * args.hidden) * args.hidden * 4   # the fused gate_up_proj, one fp32 field
        print(f"tag: optimizer files {optim / 1e6:.0f} MB; largest parameter (gate_up_proj) {biggest / 1e6:.1f} MB "
              "per field, 3 fields (fp32, exp_avg, exp_avg_sq)", flush=True)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-c", _CONVERT, tag, os.path.join(ckpt, "t_universal")], env=env,
                             capture_output=True, text=True, check=True).stdout
        count, rise, maxrss = map(int, next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:])
        print(f"(a) ds_to_universal ({count} parameters): peak anonymous RSS rise {rise / 1e6:.0f} MB, "
              f"peak RSS {maxrss / 1e6:.0f} MB", flush=True)
        for ep, what in ((4, "(b) load_checkpoint tp 2 x ep 2 -> tp 2 x ep 4 (joined)"),
                         (2, "(c) load_checkpoint at the same layout (tp 2 x ep 2: each rank's own pieces)")):
            results = run_distributed(4, load_job, args.hidden, ckpt, ep, timeout=900)
            print(f"{what}, 4 ranks: peak anonymous RSS rise per rank {[round(r[0] / 1e6) for r in results]} MB; "
                  f"joins per rank {[r[1] for r in results]} of {[r[2] for r in results]} (parameter, field) pairs",
                  flush=True)


if __name__ == "__main__":
    main()
