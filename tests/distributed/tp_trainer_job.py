"""The Hugging Face Trainer with `tensor_parallel.autotp_size` in its DeepSpeed config (transformers calls
deepspeed.tp_model_init, then initialize; Accelerate builds its `tp` device mesh and gives both TP ranks the
same batches), against the same Trainer on one process without TP. save_model goes through Accelerate's
get_state_dict -> engine._consolidated_16bit_state_dict: whole weights."""

from __future__ import annotations

import os

import torch


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_run(out: str, tp: int, stage: int, steps: int = 4) -> dict:
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    from tp_engine_jobs import SEQ, VOCAB, build

    AcceleratorState._reset_state()
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
              "steps_per_print": 10**6}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-2,
                             max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], deepspeed=config, use_cpu=True, dataloader_drop_last=True, seed=0)
    trainer = Trainer(model=build("llama"), args=args, train_dataset=_Data(64, VOCAB, SEQ))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    from deepspeed.module_inject.layers import tensor_parallel_size

    sharded_for = tensor_parallel_size(trainer.model)
    trainer.save_model(out)
    if trainer.args.process_index != 0:   # rank 0 writes the file
        return {"losses": losses, "saved": {}, "tp": sharded_for}
    from safetensors.torch import load_file

    path = os.path.join(out, "model.safetensors")
    saved = load_file(path) if os.path.exists(path) else torch.load(os.path.join(out, "pytorch_model.bin"))
    return {"losses": losses, "saved": {k: v.float() for k, v in saved.items()}, "tp": sharded_for}


def accelerate_run(tp: int, steps: int = 3, micro: int = 4, lr: float = 0.5, clip: float = 1.0) -> dict:
    """Accelerate's hand-written loop, `accelerator.prepare(model, optimizer, loader)`, with
    `tensor_parallel.autotp_size` in the DeepSpeed config (ZeRO-1): initialize shards the model, Accelerate's
    `tp` mesh gives both TP ranks the same batches. Then OpenRLHF's weight sync: one parameter at a time
    inside `deepspeed.module_inject.layers.GatherReplacedLayerParams([param], model, enabled=True)`."""
    import deepspeed
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import InitProcessGroupKwargs

    from tp_engine_jobs import build, make_data

    AcceleratorState._reset_state()
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "gradient_clipping": clip, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
              "tensor_parallel": {"autotp_size": tp}}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                      kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = build("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rows = torch.cat(make_data(steps, micro))       # the reference's global batches, in order
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=micro, shuffle=False)
    engine, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses, batches = [], []
    for (ids,) in loader:
        loss = engine(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        batches.append(ids[:, 0].tolist())
    module = acc.unwrap_model(engine)
    local = {n: tuple(p.shape) for n, p in module.named_parameters()}
    full, inside = {}, {}
    for name, param in module.named_parameters():
        with deepspeed.module_inject.layers.GatherReplacedLayerParams([param], module, enabled=True):
            full[name] = param.data.detach().clone()          # what OpenRLHF broadcasts to vLLM
            inside[name] = tuple(param.shape)
    after = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return {"losses": losses, "batches": batches, "params": full, "local": local, "inside": inside,
            "after": after, "tp_world": deepspeed.utils.groups.get_tensor_model_parallel_world_size()}
