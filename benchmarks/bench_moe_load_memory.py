"""Peak anonymous RSS rise of load_checkpoint of an MoE-layout checkpoint (issue 40 part 2 item 3):
`tests/distributed/test_nvme_moe_checkpoint.py`'s `_BigMoE` (16 experts of 1024^2, ep 2 on 2 ranks, ZeRO-2,
107 MB of optimizer state per rank), built, stepped and saved; a second engine, built and stepped, loads it.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_moe_load_memory.py [--autoep]

`--autoep`: an HF Mixtral (2 layers, hidden 512, 8 experts of intermediate 1024) under AutoEP, autoep_size 2,
NVMe only (~13.8M parameters = ~166 MB of optimizer state per rank; a local gate_up_proj is one 50 MB sub-group).

Measured after `malloc_trim`, so memory the first engine freed (kept by malloc) does not hide the rise.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "distributed"))


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64)
    return MixtralForCausalLM(config)


def job(cfg: dict, save_dir: str) -> int:
    import deepspeed
    from deepspeed.utils.rss_peak import peak_anon_rise
    from test_nvme_moe_checkpoint import _BigMoE

    def stepped(seed: int):
        torch.manual_seed(seed)
        model = _mixtral() if "expert_parallel" in cfg else _BigMoE()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if "expert_parallel" in cfg:
            ids = torch.randint(0, 256, (2, 16))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        else:
            engine.backward(engine(torch.randn(8, 1024), torch.randint(0, 4, (8,))))
        engine.step()
        return engine

    first = stepped(0)
    first.save_checkpoint(save_dir, tag="m")
    first.destroy()
    del first
    other = stepped(1)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return peak_anon_rise(lambda: other.load_checkpoint(save_dir, tag="m"))[1]


def main() -> None:
    from harness import run_distributed

    swap = tempfile.mkdtemp()
    autoep = "--autoep" in sys.argv
    cases = [("NVMe", {"device": "nvme", "nvme_path": swap}), ("CPU offload", {"device": "cpu"}), ("no offload", None)]
    for name, offload in cases[:1] if autoep else cases:
        zero = {"stage": 2, "reduce_bucket_size": 1 << 20}
        if offload:
            zero["offload_optimizer"] = offload
        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}
        if autoep:
            cfg["train_micro_batch_size_per_gpu"] = 2
            cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2}
        with tempfile.TemporaryDirectory() as directory:
            peaks = run_distributed(2, job, cfg, os.path.join(directory, "ckpt"), timeout=600)
        what = "AutoEP Mixtral" if autoep else "MoE"
        print(f"{what} ZeRO-2 ep 2, 2 ranks, {name}: load_checkpoint peak anonymous RSS rise per rank "
              f"{[round(p / 1e6) for p in peaks]} MB")


if __name__ == "__main__":
    main()
