"""Lightning + our `deepspeed` on 2 CPU ranks; run by tests/clients/test_lightning.py.

    python lightning_worker.py trainer STAGE OUTDIR     # Trainer: train 20 steps, resume from step 10
    python lightning_worker.py fabric STAGE OUTDIR      # Fabric: the same with fabric.save / fabric.load

Lightning's own subprocess launcher starts rank 1 by re-running this command line. Rank 0 writes
OUTDIR/result.json: per-step losses and learning rates of the full run and of the resumed run, and
paths of the checkpoints and of the weights gathered from the trained engine.

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA (`setup_environment`) and wants
parallel devices indexed 0..N-1; `CPUDeepSpeedStrategy` is the few lines a user writes to run it on
CPU (the README's "Use with Lightning" section).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

STEPS, RESUME_AT, WORLD, MICRO = 20, 10, 2, 4


def make_data():
    """One epoch of STEPS batches per rank whose second half repeats the first: a resumed run
    restarts a plain (unshuffled) DataLoader at its first batch, as Lightning does mid-epoch, and
    still sees what steps 11-20 of the uninterrupted run saw."""
    g = torch.Generator().manual_seed(0)
    n = RESUME_AT * WORLD * MICRO
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    x = torch.cat([x, x])
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(dim=1))


def make_net():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def lr_lambda(step):
    return 1.0 / (1.0 + 0.1 * step)


def cpu_strategy(module, stage, **extra):
    """Lightning's DeepSpeedStrategy, allowed on CPU: the lines a user writes."""
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies.ddp import DDPStrategy as TrainerDDP

    base = module.DeepSpeedStrategy
    ddp = FabricDDP if module.__name__.startswith("lightning.fabric") else TrainerDDP

    class CPUDeepSpeedStrategy(base):
        def setup_environment(self):
            ddp.setup_environment(self)  # skip DeepSpeedStrategy's "only CUDA" check

    # indexed CPU devices satisfy Lightning's device-index check (tensors on cpu:i live on the CPU)
    return CPUDeepSpeedStrategy(stage=stage, parallel_devices=[torch.device("cpu", i) for i in range(WORLD)],
                                process_group_backend="gloo", **extra)


def full_weights(engine):
    """fp32 weights of the trained model, gathered on every rank (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: safe_get_full_fp32_param(p).detach().clone().cpu() for name, p in engine.module.named_parameters()}


# --------------------------------------------------------------------------------------------- Trainer


def run_trainer(stage, out):
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.deepspeed as pl_ds

    class Net(pl.LightningModule):
        def configure_model(self):
            # Lightning runs this hook inside deepspeed.zero.Init (stage 3: built partitioned)
            if not hasattr(self, "net"):
                self.net = make_net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def train_dataloader(self):
            # Lightning's own sampler always shuffles training data; this one keeps make_data's order
            data = make_data()
            sampler = torch.utils.data.DistributedSampler(data, WORLD, self.global_rank, shuffle=False)
            return torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Record(pl.Callback):
        """Per-step loss and learning rate; `trainer.save_checkpoint` after step RESUME_AT."""

        def __init__(self, save_at):
            self.rows, self.save_at = [], save_at

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.rows.append([trainer.global_step, float(outputs["loss"]), lr, batch_idx, float(batch[0].sum())])
            if self.save_at and trainer.global_step == RESUME_AT:
                trainer.save_checkpoint(self.save_at)

    def fit(save_at=None, ckpt_path=None):
        rec = Record(save_at)
        trainer = pl.Trainer(strategy=cpu_strategy(pl_ds, stage), accelerator="cpu", devices=WORLD,
                             max_steps=STEPS, callbacks=[rec], logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, enable_model_summary=True, gradient_clip_val=1.0,
                             use_distributed_sampler=False, default_root_dir=out)
        trainer.fit(Net(), ckpt_path=ckpt_path)
        return trainer, rec.rows

    step10 = os.path.join(out, "step10.ckpt")
    trainer, full = fit(save_at=step10)
    weights = full_weights(trainer.strategy.deepspeed_engine)
    final = os.path.join(out, "final.ckpt")
    trainer.save_checkpoint(final)
    trainer2, resumed = fit(ckpt_path=step10)
    weights2 = full_weights(trainer2.strategy.deepspeed_engine)
    if trainer.is_global_zero:
        torch.save({"full": weights, "resumed": weights2}, os.path.join(out, "weights.pt"))
        _write(out, full=full, resumed=resumed, final=final, step10=step10)


# --------------------------------------------------------------------------------------------- Fabric


def nvme_options(out):
    """ZeRO-Infinity as Lightning spells it (its "deepspeed_stage_3_offload_nvme" preset): parameters
    and optimizer state on NVMe, the model built under zero.Init(remote_device="nvme")."""
    path = os.path.join(out, "nvme")
    os.makedirs(path, exist_ok=True)
    return {"offload_optimizer": True, "offload_optimizer_device": "nvme", "offload_parameters": True,
            "offload_params_device": "nvme", "remote_device": "nvme", "nvme_path": path}


def run_fabric(stage, out, nvme=False):
    import lightning.fabric.strategies.deepspeed as fab_ds
    from lightning.fabric import Fabric

    extra = nvme_options(out) if nvme else {}
    fabric = Fabric(strategy=cpu_strategy(fab_ds, stage, **extra), accelerator="cpu", devices=WORLD)
    fabric.launch()
    # train_micro_batch_size_per_gpu is only known to the user here (Fabric defaults it to 1)
    fabric.strategy.config["train_micro_batch_size_per_gpu"] = MICRO
    fabric.strategy.config["gradient_clipping"] = 1.0

    def setup():
        with fabric.init_module():
            net = make_net()
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        net, opt, sched = fabric.setup(net, opt, scheduler=sched)
        loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(make_data(), batch_size=MICRO, shuffle=False))
        return net, opt, sched, loader

    def train(net, opt, sched, loader, start, stop):
        rows, it = [], iter(loader)
        for _ in range(start):  # skip what the first run consumed (one epoch is RESUME_AT steps)
            next(it)
        for step in range(start + 1, stop + 1):
            x, y = next(it)
            loss = F.cross_entropy(net(x), y)
            fabric.backward(loss, model=net)  # two engines exist once the resumed run starts
            # Fabric calls the DeepSpeed optimizer's step (the engine is no torch Optimizable), which
            # clips and consumes the gradients; the scheduler is the user's to step, as with DeepSpeed
            opt.step()
            sched.step()
            rows.append([step, loss.item(), opt.param_groups[0]["lr"]])
            if step == RESUME_AT:
                fabric.save(os.path.join(out, "step10"), {"model": net, "optimizer": opt, "scheduler": sched,
                                                          "step": step})
        return rows

    net, opt, sched, loader = setup()
    engine = net._forward_module
    swapping = [getattr(engine._stage3, "swapper", None) is not None, getattr(engine.optimizer, "swapper", None)
                is not None]   # NVMe: parameter shards and optimizer state in swap files
    full = train(net, opt, sched, loader, 0, STEPS)
    weights = full_weights(net._forward_module)
    final = os.path.join(out, "final")
    fabric.save(final, {"model": net, "optimizer": opt, "scheduler": sched, "step": STEPS})

    net, opt, sched, loader = setup()
    state = {"model": net, "optimizer": opt, "scheduler": sched, "step": 0}
    fabric.load(os.path.join(out, "step10"), state)
    resumed = train(net, opt, sched, loader, state["step"], STEPS)
    weights2 = full_weights(net._forward_module)
    if fabric.is_global_zero:
        torch.save({"full": weights, "resumed": weights2}, os.path.join(out, "weights.pt"))
        _write(out, full=full, resumed=resumed, final=final, step10=os.path.join(out, "step10"), swapping=swapping)


def _write(out, **result):
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    {"trainer": run_trainer, "fabric": run_fabric,
     "fabric-nvme": lambda stage, out: run_fabric(stage, out, nvme=True)}[mode](stage, out)
