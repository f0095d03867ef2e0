"""TRL and PEFT on this deepspeed, 2 ranks on CPU, each compared with the same 2-rank job under
plain DDP (no DeepSpeed): same initial weights, data order, optimizer (Trainer's torch AdamW) and
seed, so only where the gradients are summed differs.

    deepspeed --num_gpus 2 tests/clients/trl_peft_worker.py --out DIR --variants sft:2,sft:3,...

Kinds: sft (SFTTrainer, TRL's defaults: its fused LM-head loss, gradient checkpointing on), dpo
(DPOTrainer with the reference model TRL builds from the policy's path), grpo (GRPOTrainer,
generation through TRL's unwrap_model_for_generation, no vLLM), lora (SFTTrainer with a PEFT LoRA
config). `kind:stage` runs it at that ZeRO stage; the DDP run of a kind is made once. Per logged
step the loss and grad norm (and GRPO's mean reward: the same completions were sampled) must match.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hf_common as C  # noqa: E402

STEPS = 3
# fp32 on both sides, the same data, seed and torch AdamW: DDP all-reduces whole gradients, ZeRO
# reduce-scatters them packed per unit or bucket, so the sums (and the clipped grad norm) differ
# in the last bits. Measured over the 3 steps of every variant: losses equal to the bit, grad
# norms within 1.6e-7 relative (GRPO's rewards equal: the same completions were sampled). 1e-6
# leaves headroom for another CPU's rounding; a wrong gradient (a parameter missed or counted
# twice, a wrong average) is off by percents.
RTOL, ATOL = 1e-6, 1e-7


def ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:   # nothing persistent: every parameter, lm_head included, is released between uses
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "steps_per_print": 1000}


def datasets_for(kind: str):
    from datasets import Dataset

    data = C.TokenData(32, seed=1)
    words = [" ".join(f"t{max(int(i), 4)}" for i in row) for row in data.ids]
    if kind in ("sft", "lora"):
        return Dataset.from_dict({"input_ids": [row.tolist() for row in data.ids]})
    if kind == "dpo":   # chosen continues the count, rejected repeats the last prompt token
        return Dataset.from_dict({"prompt": [" ".join(w.split()[:8]) for w in words],
                                  "chosen": [" ".join(w.split()[8:12]) for w in words],
                                  "rejected": [" ".join([w.split()[7]] * 4) for w in words]})
    return Dataset.from_dict({"prompt": [" ".join(w.split()[:6]) for w in words]})


def even_tokens(completions, **kwargs) -> list[float]:
    """GRPO reward: the share of completion tokens with an even id."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split() if w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def make_trainer(kind: str, stage: int | None, init: str, out: str, rows: list):
    import transformers
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import trl

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                rows.append({k: float(logs[k]) for k in ("loss", "grad_norm", "reward") if k in logs})

    # One Trainer after another in this process, DeepSpeed or DDP: a fresh accelerate state of the
    # right kind each time (the gloo process group stays). HF_SURFACE 2.1: Trainer on CPU uses a
    # pre-configured state; cpu=True makes it plain DDP (MULTI_CPU) when DeepSpeed is off.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "false" if stage is None else "true"
    PartialState(backend="gloo", cpu=stage is None)
    common = dict(output_dir=out, max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                  report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
                  deepspeed=None if stage is None else ds_config(stage), bf16=False,
                  accelerator_config={"use_configured_state": True})
    tok = C.tiny_tokenizer()
    if kind == "grpo":
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                              **common)
    elif kind == "dpo":
        args = trl.DPOConfig(per_device_train_batch_size=2, **common)
    else:
        args = trl.SFTConfig(per_device_train_batch_size=4, **common)
    model = AutoModelForCausalLM.from_pretrained(init)   # under zero.Init at ZeRO-3
    torch.manual_seed(0)   # LoRA's initial weights: the same on both sides
    data = datasets_for(kind)
    if kind == "grpo":
        return trl.GRPOTrainer(model=model, reward_funcs=even_tokens, args=args, train_dataset=data,
                               processing_class=tok, callbacks=[Record()])
    if kind == "dpo":
        return trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[Record()])
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                          peft_config=peft_config, callbacks=[Record()])


def train(kind: str, stage: int | None, init: str, root: str) -> list[dict]:
    rows: list[dict] = []
    trainer = make_trainer(kind, stage, init, os.path.join(root, f"{kind}-{stage or 'ddp'}"), rows)
    trainer.train()
    engine = trainer.model_wrapped
    if stage is not None:
        assert engine.zero_optimization_stage() == stage, (kind, stage)
        if kind == "lora":
            trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
            assert trainable and all("lora_" in n for n in trainable), trainable
    else:
        assert type(engine).__name__ == "DistributedDataParallel", type(engine)
    assert len(rows) == STEPS, rows
    del trainer, engine
    return rows


def compare(ref: list[dict], got: list[dict], what: str) -> float:
    """Largest relative difference of the logged values; raises beyond RTOL/ATOL."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(ref, got)):
        assert a.keys() == b.keys(), (what, a, b)
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=RTOL, abs_tol=ATOL), \
                f"{what} step {step + 1} {key}: DDP {a[key]!r} vs DeepSpeed {b[key]!r}\n{ref}\n{got}"
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), ATOL))
    return worst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="sft:2,sft:3,dpo:2,dpo:3,grpo:2,grpo:3,lora:3")
    a = p.parse_args()
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    PartialState(backend="gloo")
    init = os.path.join(a.out, "init")
    if C.rank() == 0:   # TRL builds DPO's reference model from the policy's path: a saved model
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(C.tiny_config()).save_pretrained(init)
        C.tiny_tokenizer().save_pretrained(init)
    torch.distributed.barrier()
    baselines, results = {}, {}
    for variant in a.variants.split(","):
        kind, stage = variant.split(":")
        if kind not in baselines:
            baselines[kind] = train(kind, None, init, a.out)
        got = train(kind, int(stage), init, a.out)
        results[variant] = {"ddp": baselines[kind], "deepspeed": got,
                            "worst_rel": compare(baselines[kind], got, variant)}
    C.report(results)
    C.finish()


if __name__ == "__main__":
    main()
