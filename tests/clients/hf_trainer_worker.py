"""Trainer under DeepSpeed, 2 ranks on CPU: train 20 steps (checkpoint at 10), resume from step 10
in a second Trainer, then check losses, learning rates, saved weights and zero_to_fp32.

    deepspeed --num_gpus 2 tests/clients/hf_trainer_worker.py --out DIR --variants z2,z3,z3bf16hf

Variants: z2 / z3 = json config with DeepSpeed's AdamW + WarmupDecayLR (fp32); z3nvme = z3 with the
transformers docs' ZeRO-Infinity sections (offload_param / offload_optimizer "nvme"); z3bf16hf = bf16,
the optimizer and scheduler made by Trainer (torch AdamW, a callable `lr_scheduler`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hf_common as C  # noqa: E402

VARIANTS = {
    "z2": dict(stage=2, bf16=False, ds_optim=True),
    "z3": dict(stage=3, bf16=False, ds_optim=True),
    "z3bf16hf": dict(stage=3, bf16=True, ds_optim=False),
    "z3nvme": dict(stage=3, bf16=False, ds_optim=True),   # + ZeRO-Infinity: params and optimizer on NVMe
}


def nvme_offload(cfg: dict, path: str) -> dict:
    """The transformers docs' ZeRO-Infinity sections: parameters and optimizer state to NVMe."""
    cfg["zero_optimization"].update(
        offload_optimizer={"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 4,
                           "fast_init": False},
        offload_param={"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 5,
                       "buffer_size": 1e8, "max_in_cpu": 1e9})
    cfg["aio"] = {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                  "overlap_events": True}
    return cfg


def ds_config(stage: int, bf16: bool, ds_optim: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto"},
        "steps_per_print": 1000, "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                                        stage3_gather_16bit_weights_on_model_save=True)
    if ds_optim:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    return cfg


class Record:
    """A TrainerCallback collecting (step, loss, lr) from every log."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        rec = self

        class CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    rec.rows.append((state.global_step, float(logs["loss"]), float(logs["learning_rate"])))

        self.rows: list = []
        self.callback = CB()


def make_trainer(out: str, cfg_path: str, bf16: bool, train, callback):
    import transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from accelerate.state import AcceleratorState, GradientState

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True   # HF_SURFACE 2.2
    AcceleratorState._reset_state()   # a second Trainer in this process (keeps the gloo PartialState)
    GradientState._reset_state()
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=20,
        learning_rate=3e-3, warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=10, report_to=[], deepspeed=cfg_path, bf16=bf16,
        accelerator_config={"use_configured_state": True}, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(C.tiny_config())   # under zero.Init at stage 3
    return Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])


def run_variant(name: str, root: str, train, evald, script_check: bool) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    v = VARIANTS[name]
    out1, out2 = os.path.join(root, name, "run1"), os.path.join(root, name, "run2")
    cfg_path = os.path.join(root, name, "ds_config.json")
    if C.rank() == 0:
        os.makedirs(os.path.dirname(cfg_path), exist_ok=True)
        cfg = ds_config(**v)
        if name == "z3nvme":
            cfg = nvme_offload(cfg, os.path.join(root, "nvme"))
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    torch.distributed.barrier()

    if name == "z3":   # inference only: initialize without an optimizer (Trainer drops those sections)
        trainer = make_trainer(os.path.join(root, name, "eval"), cfg_path, v["bf16"], train, Record().callback)
        metrics = trainer.evaluate(evald)
        assert 4.0 < metrics["eval_loss"] < 6.0, metrics
        del trainer

    rec1 = Record()
    trainer = make_trainer(out1, cfg_path, v["bf16"], train, rec1.callback)
    assert all(hasattr(p, "ds_numel") for p in trainer.model.parameters()) == (v["stage"] == 3)
    trainer.train()
    engine = trainer.model_wrapped
    assert engine.config.get("zero_optimization", {}).get("stage") == v["stage"]
    if name == "z3nvme":   # parameter shards and optimizer state really in swap files
        assert engine._stage3.swapper is not None and engine.optimizer.swapper is not None
    del trainer, engine

    rec2 = Record()
    trainer = make_trainer(out2, cfg_path, v["bf16"], train, rec2.callback)
    trainer.train(resume_from_checkpoint=os.path.join(out1, "checkpoint-10"))
    steps1 = [r for r in rec1.rows if r[0] > 10]
    assert [r[0] for r in rec2.rows] == list(range(11, 21)), rec2.rows
    C.check_falls([r[1] for r in rec1.rows], name)
    C.check_same([r[1] for r in steps1], [r[1] for r in rec2.rows], f"{name} resumed losses", 1e-3)
    C.check_same([r[2] for r in steps1], [r[2] for r in rec2.rows], f"{name} resumed lrs", 1e-6)

    final = os.path.join(out2, "final")
    trainer.save_model(final)
    engine_eval = C.full_eval_loss(trainer.model_wrapped, evald)
    result = {"losses": [r[1] for r in rec1.rows], "engine_eval": engine_eval}

    if v["stage"] == 3:   # from_pretrained under zero.Init (GatheredParameters(modifier_rank=0) loading)
        from safetensors.torch import load_file

        import deepspeed

        saved = load_file(os.path.join(final, "model.safetensors"))
        z3 = AutoModelForCausalLM.from_pretrained(final)
        params = dict(z3.named_parameters())
        assert all(hasattr(p, "ds_numel") and p.ds_tensor is not None for p in params.values())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            got = {k: p.detach().clone() for k, p in params.items()}
        C.compare_state_dicts(saved, got, f"{name} from_pretrained under ZeRO-3")
        z3.resize_token_embeddings(C.VOCAB + 8)
        emb = z3.get_input_embeddings().weight
        with deepspeed.zero.GatheredParameters([emb]):
            assert emb.shape[0] == C.VOCAB + 8
            assert torch.equal(emb[:C.VOCAB].float(), saved["model.embed_tokens.weight"].float())
        del z3

    if C.rank() == 0:
        unset_hf_deepspeed_config()   # rank 0 alone: a plain (non-ZeRO-3) from_pretrained
        model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        reload_eval = C.full_eval_loss(model, evald)
        tol = 2e-2 if v["bf16"] else 1e-5
        assert abs(reload_eval - engine_eval) <= tol * abs(engine_eval), (reload_eval, engine_eval)
        result["reload_eval"] = reload_eval
        weights = {k: t for k, t in model.state_dict().items() if "rotary" not in k}
        fp32_2 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out2, "checkpoint-20"))
        fp32_1 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out1, "checkpoint-20"))
        C.compare_state_dicts(weights, fp32_2, f"{name} zero_to_fp32 vs saved weights")
        C.compare_state_dicts(fp32_1, fp32_2, f"{name} resumed final weights", atol=1e-6)
        for ckpt in ("checkpoint-10", "checkpoint-20"):
            d = os.path.join(out1, ckpt)
            assert os.path.exists(os.path.join(d, "zero_to_fp32.py")), os.listdir(d)
            assert open(os.path.join(d, "latest")).read().strip() == f"global_step{ckpt.split('-')[1]}"
        if script_check:   # the standalone script copied beside the checkpoint
            d = os.path.join(out2, "checkpoint-20")
            subprocess.run([sys.executable, os.path.join(d, "zero_to_fp32.py"), d, os.path.join(root, name, "fp32")],
                           check=True, capture_output=True)
            script_sd = torch.load(os.path.join(root, name, "fp32", "pytorch_model.bin"), weights_only=True)
            C.compare_state_dicts(fp32_2, script_sd, f"{name} zero_to_fp32.py script")
    torch.distributed.barrier()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="z2,z3,z3bf16hf")
    a = p.parse_args()
    from accelerate import PartialState

    PartialState(backend="gloo")   # HF_SURFACE 2.1: Trainer on CPU uses a pre-configured state
    train, evald = C.TokenData(64, seed=1), C.TokenData(32, seed=2)
    results = {}
    for i, name in enumerate(a.variants.split(",")):
        results[name] = run_variant(name, a.out, train, evald, script_check=(i == 0))
    C.report(results)
    C.finish()


if __name__ == "__main__":
    main()
