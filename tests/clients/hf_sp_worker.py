"""Ulysses sequence parallelism (ALST) driven unchanged by Hugging Face, 2 ranks = one SP group of 2:

    deepspeed --num_gpus 2 tests/clients/hf_sp_worker.py --out DIR --variants trainer-z2,trainer-z3,...

Variants
- trainer-z2 / trainer-z3: `Trainer` with `TrainingArguments(deepspeed=cfg, parallelism_config=
  ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(...)))`:
  accelerate registers the Ulysses attention and the mpu, Trainer wraps its loader in
  UlyssesSPDataLoaderAdapter and computes the loss with `deepspeed_sp_compute_loss`.
- trainer-z3-tiled: the same with axolotl's TiledMLP patch (`TiledMLP.apply(fn, self, x, num_shards,
  compute_params)` in LlamaMLP.forward; 8 local tokens in 3 uneven tiles).
- accelerate-z1: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(...), parallelism_config=...)` with a
  hand-written loop: `prepare(model, optimizer, dl)` then the shard losses joined by token count.
- trainer-z2-tp2 / trainer-z3-tp2 / accelerate-z1-tp2 (launch with --num_gpus 4 = sp 2 x tp 2): the same
  with `tensor_parallel: {autotp_size: 2}` in the DeepSpeed config. Trainer calls `deepspeed.tp_model_init`
  in `deepspeed_init`, then accelerate registers ALST; Accelerate registers ALST and wraps the loader
  before `deepspeed.initialize` adds the tensor dim (the adapter follows the refined sequence groups).
  The model is built before TrainingArguments there: Trainer's ZeRO-3 `zero.Init` model is refused by
  tp_model_init (docs/parallelism.md).

Every variant: each step's loss equals the mean full-sequence loss of the same model on the same
samples, and the logged gradient norms and the weights after STEPS of SGD (scale-sensitive, clipped)
equal one plain process training on the full sequences (fp32, ~1e-5); the loss falls.

World 2 = SP 2 for the SP-only variants: transformers' loss join uses torch.distributed.nn.functional.all_gather,
whose backward on gloo passes group ranks where torch wants global ones (`dist.scatter(src=...)`), so
it fails in every SP group that is not ranks 0..sp-1. That is torch's, not DeepSpeed's (NCCL takes another
path); the engine-level tests (tests/distributed) cover SP x DP with a differentiable gather of their own,
and the TP variants (whose SP groups are {0, 2} and {1, 3}) patch torch's gloo fallback
(sp_common.fix_gloo_autograd_all_gather).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hf_common as C  # noqa: E402
import sp_common as S  # noqa: E402

# MICRO = 2: the adapter's shards must be contiguous, as transformers' loss `view`s them
# (test_sequence_parallel_models.py::test_adapter_shards_are_contiguous)
SP, MICRO, STEPS, LR, CLIP = 2, 2, 8, 1.0, 1.0
N = STEPS * MICRO   # one epoch: every sample once
VARIANTS = {
    "trainer-z2": dict(stage=2, tiled=False),
    "trainer-z3": dict(stage=3, tiled=False),
    "trainer-z3-tiled": dict(stage=3, tiled=True),
    "accelerate-z1": dict(stage=1, tiled=False),
    # world 4 = sp 2 x tp 2: `tensor_parallel.autotp_size` in the DeepSpeed config beside ParallelismConfig's SP
    "trainer-z2-tp2": dict(stage=2, tiled=False, tp=2),
    "trainer-z3-tp2": dict(stage=3, tiled=False, tp=2),
    "accelerate-z1-tp2": dict(stage=1, tiled=False, tp=2),
}


def ds_config(stage: int, trainer: bool, tp: int = 1) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1 if not trainer else "auto",
           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if trainer:   # DeepSpeed's SGD, lr filled by Trainer
        cfg["train_batch_size"] = "auto"
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": "auto"}}
    return cfg


def parallelism_config():
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=SP, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))


def sp_group():
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def new_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(C.tiny_config(), attn_implementation="sdpa")


class TiledLlamaMLP:
    """axolotl's patch: LlamaMLP.forward replaced by a TiledMLP call, ranks agreeing on the tile count."""

    def __enter__(self):
        from transformers.models.llama import modeling_llama

        import deepspeed.comm as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        self.cls, self.orig, self.calls = modeling_llama.LlamaMLP, modeling_llama.LlamaMLP.forward, 0
        patch = self

        def tiled_forward(self, x):
            shards = torch.tensor(math.ceil(x.shape[-2] / 3))
            dist.all_reduce(shards, op=dist.ReduceOp.MAX)
            compute_params = [p for p in self.parameters() if p.requires_grad]

            def mlp_forward(self, x):
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

            patch.calls += 1
            return TiledMLP.apply(mlp_forward, self, x, int(shards), compute_params)

        self.cls.forward = tiled_forward
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.orig


def check_tensor_parallel(engine, tp: int) -> None:
    """AutoTP really sharded the model: q_proj is a slice on a tensor group of `tp` ranks."""
    from deepspeed.module_inject.layers import is_tensor_parallel
    from deepspeed.utils import groups

    assert groups.get_tensor_model_parallel_world_size() == tp
    q = engine.module.model.layers[0].self_attn.q_proj.weight
    rows = getattr(q, "ds_shape", q.shape)[0]   # ZeRO-3: the (TP-local) shape before partitioning
    assert is_tensor_parallel(q) == (tp > 1) and rows * tp == C.tiny_config().hidden_size, (tp, rows)


def restore_sdpa(original) -> None:
    """Each variant registers the Ulysses attention again; start each from transformers' own sdpa."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def check_against_reference(name: str, data, seen: list, losses: list, norms: list, init: dict, final: dict,
                            logged: list | None = None) -> dict:
    """`seen`: per step the gathered (input_ids, position_ids, shift_labels) of the full batch."""
    batches, used = [], []
    for ids, pos, shift in seen:
        rows, full_ids, full_shift = data.full_batch(ids, pos, shift)
        batches.append((full_ids, full_shift))
        used += rows
    assert len(batches) == STEPS, (name, len(batches))
    assert sorted(used) == list(range(N)), f"{name}: each sample once per epoch: {sorted(used)}"
    ref = S.full_sequence_sgd(init, batches, LR, CLIP)
    S.check_close(losses, ref["losses"], f"{name} loss vs full sequence")
    S.check_close(norms, ref["norms"], f"{name} grad norm vs full sequence")
    if logged is not None:
        S.check_close(logged, ref["losses"], f"{name} Trainer-logged loss vs full sequence")
    S.check_params(final, ref["params"], f"{name} weights after {STEPS} SGD steps")
    assert max(ref["norms"]) > CLIP, f"{name}: clipping never engaged: {ref['norms']}"
    before, after = S.dataset_loss(init, data), S.dataset_loss(final, data)
    assert after < 0.98 * before, f"{name}: the loss over the dataset did not fall: {before} -> {after}"
    return {"losses": losses, "norms": norms, "dataset_loss": [before, after]}


def run_trainer(name: str, root: str, data) -> dict:
    import transformers
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    v = VARIANTS[name]
    seen, losses, logged, norms = [], [], [], []

    class SPTrainer(Trainer):
        """Records what Trainer's own compute_loss (deepspeed_sp_compute_loss under SP) returns, and
        the full batch behind this step's shards."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                assert inputs["input_ids"].shape[1] == S.SEQ // SP and "labels" not in inputs, inputs.keys()
                group = sp_group()
                seen.append(tuple(S.gather_shards(inputs[k], group) for k in ("input_ids", "position_ids",
                                                                               "shift_labels")))
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(float(logs["loss"]))
                norms.append(float(logs["grad_norm"]))

    AcceleratorState._reset_state()
    GradientState._reset_state()
    model = None
    if v.get("tp", 1) > 1:
        # built before TrainingArguments, so not under zero.Init: Trainer's tp_model_init shards a whole model
        # (a zero.Init-partitioned one is refused: docs/parallelism.md, SP x TP through Hugging Face)
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
        model = new_model()
    args = TrainingArguments(
        output_dir=os.path.join(root, name), per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=CLIP,
        logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds_config(v["stage"], True, v.get("tp", 1)),
        parallelism_config=parallelism_config(), accelerator_config={"use_configured_state": True}, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    assert transformers.integrations.is_deepspeed_zero3_enabled() == (v["stage"] == 3)
    model = model or new_model()
    init = S.gathered_state(model)
    trainer = SPTrainer(model=model, args=args, train_dataset=data, callbacks=[Log()])
    if v["tiled"]:
        with TiledLlamaMLP() as tiled:
            trainer.train()
        assert tiled.calls >= STEPS * C.tiny_config().num_hidden_layers, tiled.calls
    else:
        trainer.train()
    engine = trainer.model_wrapped
    assert engine.zero_optimization_stage() == v["stage"]
    assert engine.seq_dp_world_size == 2 and engine.dp_world_size == 1
    check_tensor_parallel(engine, v.get("tp", 1))
    assert engine._sp_alst_seen and engine._sp_whole_checked   # the loss taken whole, checked once: no value test
    final = S.engine_params(engine)
    return check_against_reference(name, data, seen, losses, norms, init, final, logged)


def run_accelerate(name: str, data) -> dict:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import InitProcessGroupKwargs

    v = VARIANTS[name]
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(v["stage"], False, v.get("tp", 1)))
    acc = Accelerator(deepspeed_plugin=plugin, parallelism_config=parallelism_config(),
                      kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = new_model()
    init = S.gathered_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert len(loader) == STEPS, len(loader)   # the adapter: SP micro-batches per loader batch
    group = sp_group()
    seen, losses, norms = [], [], []
    for batch in loader:
        shift = batch["shift_labels"]
        assert batch["input_ids"].shape[1] == S.SEQ // SP and "labels" not in batch, batch.keys()
        seen.append(tuple(S.gather_shards(batch[k], group) for k in ("input_ids", "position_ids", "shift_labels")))
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        local = model.module.loss_function(logits=logits, labels=None, shift_labels=shift,
                                           vocab_size=model.module.config.vocab_size)
        # the client's join: every SP rank holds the sample's loss, weighted by its valid tokens
        per_rank = torch.distributed.nn.functional.all_gather(local, group=group)
        good = torch.distributed.nn.functional.all_gather((shift != -100).sum(), group=group)
        loss = sum(lo * g for lo, g in zip(per_rank, good)) / sum(good)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(model.get_global_grad_norm()))
    assert model._sp_alst_seen and model._sp_whole_checked   # ALST's attention: a whole loss, checked once
    check_tensor_parallel(model, v.get("tp", 1))
    return check_against_reference(name, data, seen, losses, norms, init, S.engine_params(model))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    from accelerate import PartialState
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    PartialState(backend="gloo")   # HF_SURFACE 2.1
    tp = {VARIANTS[name].get("tp", 1) for name in a.variants.split(",")}
    assert len(tp) == 1 and torch.distributed.get_world_size() == SP * tp.pop(), "one world per launch: sp x tp"
    if torch.distributed.get_world_size() > SP:
        S.fix_gloo_autograd_all_gather()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    data = S.SPTokenData(N)
    results = {}
    for name in a.variants.split(","):
        restore_sdpa(sdpa)
        results[name] = run_trainer(name, a.out, data) if name.startswith("trainer") else run_accelerate(name, data)
    C.report(results)
    C.finish()


if __name__ == "__main__":
    main()
