"""Models, configs and per-rank jobs for the checkpoint tests (test_checkpoint*.py).

Every job runs on all ranks of a harness pool (or under the launcher) and returns a picklable
summary; collective snapshots (full fp32 masters and optimizer states) are taken on every rank
and returned from rank 0 only. A job saves with one engine and loads into a *fresh* engine
built from a different seed, so nothing the load forgets can pass by accident.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from models import TinyMLP, global_batches, micro_slice

GLOBAL_BATCH = 8
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}
STATE_FIELDS = ("exp_avg", "exp_avg_sq")
MODEL_FILE = "mp_rank_00_model_states.pt"


def model_files(stage: int, world: int) -> list[str]:
    """Model-states file names: one per rank at ZeRO-3 (each holds its frozen pieces), else one."""
    return [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3 else [MODEL_FILE]


def optim_file(rank: int, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def assert_snap_equal(saved: dict, loaded: dict, need_state: bool = True) -> None:
    assert saved.keys() == loaded.keys()
    for name, entry in saved.items():
        for field, value in entry.items():
            got = loaded[name][field]
            if need_state:
                assert value is not None, f"{name}.{field} missing at save time"
            assert got is not None or value is None, f"{name}.{field} not restored"
            if value is not None:
                assert got.dtype == value.dtype and got.shape == value.shape, (name, field)
                assert torch.equal(got, value), f"{name}.{field} differs after load"


# --- models -------------------------------------------------------------------------------------
class VarietyNet(nn.Module):
    """A frozen layer, a tied weight (embedding == output head), sizes that divide by neither 2
    nor 4 (13, 7) and a persistent buffer that changes every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.emb = nn.Embedding(4, 13)
        self.proj = nn.Linear(16, 13)
        self.odd = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.head = nn.Linear(13, 4, bias=False)
        self.head.weight = self.emb.weight  # tied: one nn.Parameter, two modules
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        tokens = torch.argmax(x[:, :4], dim=1)
        h = torch.tanh(self.proj(torch.relu(self.frozen(x))) + self.emb(tokens))
        h = torch.cat([h[:, :7] * self.odd.to(h.dtype), h[:, 7:]], dim=1)
        return F.cross_entropy(self.head(h), y)


class WideMLP(TinyMLP):
    """109,444 parameters (for the size test)."""

    def __init__(self) -> None:
        super().__init__(hidden=320)


class OtherMLP(TinyMLP):
    """TinyMLP with `fc2` renamed to `mid` and an extra layer: a different model."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = self.fc2
        del self.fc2
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.relu(self.fc1(x))))
        return F.cross_entropy(self.extra(self.head(h)), y)


MODELS = {"tiny": TinyMLP, "variety": VarietyNet, "wide": WideMLP, "other": OtherMLP}


def make(model: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[model]()


# --- configs ------------------------------------------------------------------------------------
def config(stage: int, world: int, precision: str = "fp32", gas: int = 1, offload: bool = False,
           scheduler: bool = True, **extra: Any) -> dict:
    """A config whose global batch is GLOBAL_BATCH whatever the world size and accumulation."""
    micro = GLOBAL_BATCH // (gas * world)
    assert micro * gas * world == GLOBAL_BATCH
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                           "gradient_clipping": 0.0, "steps_per_print": 10**6, "zero_optimization": zero}
    if scheduler:
        cfg["scheduler"] = copy.deepcopy(SCHEDULER)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # 2**16 * loss overflows fp16 at once, and a window of 2 grows the scale back into the next
        # overflow: the scaler state (scale, iteration, last overflow, hysteresis) all moves
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2}
    cfg.update(extra)
    return cfg


# --- helpers (on every rank) --------------------------------------------------------------------
def _dist():
    import deepspeed.comm as dist

    return dist


def build(cfg: dict, model: str = "tiny", seed: int = 0) -> Any:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make(model, seed), config=copy.deepcopy(cfg))
    return engine


def batches(steps: int) -> list:
    return list(global_batches(steps, GLOBAL_BATCH))


def train(engine: Any, todo: list) -> list[float]:
    """One optimizer step per global batch; returns the global mean loss of each."""
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = next(p.dtype for p in engine.module.parameters())
    losses = []
    for x, y in todo:
        total = torch.zeros(())
        for k in range(gas):
            loss = engine(micro_slice(x, micro, k, rank, world).to(dtype), micro_slice(y, micro, k, rank, world))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (gas * world))
    return losses


def snapshot(engine: Any) -> dict:
    """Full fp32 masters and optimizer states per trainable parameter (collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        entry = {"fp32": safe_get_full_fp32_param(p)}
        for field in STATE_FIELDS:
            try:
                entry[field] = safe_get_full_optimizer_state(p, field)
            except ValueError:  # no such state yet (fresh optimizer)
                entry[field] = None
        out[name] = entry
    return out


def _base_optimizer(engine: Any) -> Any:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def state(engine: Any) -> dict:
    """Counters, scheduler, loss scaler, optimizer step and the visible module state (local)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    steps = {float(s["step"]) for s in _base_optimizer(engine).state.values() if "step" in s}
    return {
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "lr": engine.get_lr(),
        "scaler": None if scaler is None else {k: getattr(scaler, k, None) for k in (
            "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")},
        "adam_step": sorted(steps),
        "module": module_state(engine),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in _base_optimizer(engine).param_groups],
    }


def module_state(engine: Any) -> dict:
    """The module's full state dict; ZeRO-3 gathers it (collective) from the released shards."""
    import contextlib

    gathered = engine._stage3.gathered() if engine._stage3 is not None else contextlib.nullcontext()
    with gathered:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _rank0(value: Any) -> Any:
    return value if _dist().get_rank() == 0 else None


# --- jobs ---------------------------------------------------------------------------------------
def save_job(cfg: dict, save_dir: str, pre: int = 3, post: int = 3, model: str = "tiny", tag: Any = None,
             client_state: Any = None, save_latest: bool = True, exclude_frozen: bool = False) -> dict:
    """Train `pre` steps, save, then keep training `post` steps (the uninterrupted run)."""
    engine = build(cfg, model, seed=0)
    data = batches(pre + post)
    pre_losses = train(engine, data[:pre])
    before, st = snapshot(engine), state(engine)
    ok = engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                exclude_frozen_parameters=exclude_frozen)
    after = snapshot(engine)  # saving must not disturb the training state
    st_after = state(engine)
    rng = draw_rng()  # what the random generators give right after the save point
    post_losses = train(engine, data[pre:])
    if _dist().get_rank() != 0:
        return {"rng": rng}
    return {"snap": before, "snap_after_save": after, "state": st, "state_after_save": st_after,
            "pre_losses": pre_losses, "post_losses": post_losses, "returned": ok, "tied": _tied(engine),
            "rng": rng}


def draw_rng() -> dict:
    import random

    return {"torch": torch.rand(4), "python": random.random()}


def load_job(cfg: dict, load_dir: str, pre: int = 3, post: int = 3, model: str = "tiny", tag: Any = None,
             seed: int = 123, train_after: bool = True, **load_kwargs: Any) -> dict:
    """A fresh engine (another seed) loads, then trains the batches after the save point."""
    engine = build(cfg, model, seed=seed)
    fresh = state(engine)
    path, client = engine.load_checkpoint(load_dir, tag=tag, **load_kwargs)
    rng = draw_rng()
    snap, st = snapshot(engine), state(engine)
    losses = train(engine, batches(pre + post)[pre:]) if train_after else None
    out = {"path": path, "client": client, "snap": snap, "state": st, "fresh": fresh, "post_losses": losses,
           "tied": _tied(engine), "rng": rng}
    if _dist().get_rank() == 0:
        return out
    return {"path": path, "client": client, "rng": rng}


def _tied(engine: Any) -> Any:
    module = engine.module
    return module.head.weight is module.emb.weight if isinstance(module, VarietyNet) else None


def expect_error_job(cfg: dict, load_dir: str, model: str = "tiny", **load_kwargs: Any) -> dict:
    """load_checkpoint must raise on this rank: returns the error's type and message."""
    engine = build(cfg, model, seed=123)
    try:
        result = engine.load_checkpoint(load_dir, **load_kwargs)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": f"no error; returned {result!r}"}


def no_latest_job(cfg: dict, load_dir: str) -> Any:
    engine = build(cfg, "tiny", seed=123)
    before = snapshot(engine)
    result = engine.load_checkpoint(load_dir)
    return {"result": result, "unchanged": _snap_equal(before, snapshot(engine)),
            "global_steps": engine.global_steps}


def _snap_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[n][f] is None and b[n][f] is None) or (a[n][f] is not None and b[n][f] is not None
                                                  and torch.equal(a[n][f], b[n][f]))
        for n in a for f in a[n])


def tag_mismatch_job(cfg: dict, save_dir: str) -> dict:
    """Ranks pass different tags (checkpoint.tag_validation FAIL raises; WARN/IGNORE save)."""
    engine = build(cfg, "tiny", seed=0)
    train(engine, batches(1))
    tag = f"rank{_dist().get_rank()}"
    try:
        engine.save_checkpoint(save_dir, tag=tag)
    except Exception as error:  # noqa: BLE001
        # the pool must still be usable: a matched save right after works
        engine.save_checkpoint(save_dir, tag="agreed")
        return {"type": type(error).__name__, "message": str(error), "assertion": isinstance(error, AssertionError)}
    return {"type": None, "message": "no error", "snap": snapshot(engine)}


def rank0_only_save_job(cfg: dict, save_dir: str, timeout_s: float) -> dict:
    """Rank 0 alone calls save_checkpoint (a classic user bug); then rank 1 arrives late.

    Sequencing uses the c10d store (rank 0 announces it gave up), not sleeps. Every rank makes
    the same number of arrival calls in the end, and a final arrival probe checks that the pool
    is still consistent."""
    import time

    import torch.distributed as tdist

    from deepspeed.comm import rendezvous

    engine = build(cfg, "tiny", seed=0)
    train(engine, batches(1))
    rank = _dist().get_rank()
    store = tdist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    old = rendezvous.DEFAULT_TIMEOUT_S
    rendezvous.DEFAULT_TIMEOUT_S = timeout_s
    try:
        if rank == 0:
            start = time.monotonic()
            try:
                engine.save_checkpoint(save_dir, tag="only0")
                out["error"] = None
            except Exception as error:  # noqa: BLE001
                out["error"] = (type(error).__name__, str(error))
            out["elapsed"] = time.monotonic() - start
            store.set("ckpt_test/rank0_gave_up", "1")
        else:
            store.wait(["ckpt_test/rank0_gave_up"])
            # the straggler: arrives after rank 0 gave up; it must time out too, not go on alone
            start = time.monotonic()
            try:
                rendezvous.arrive_and_wait("save_checkpoint", timeout_s=timeout_s)
                out["straggler_error"] = None
            except Exception as error:  # noqa: BLE001
                out["straggler_error"] = (type(error).__name__, str(error))
            out["elapsed"] = time.monotonic() - start
        # both ranks have now made one arrival call each: a matched probe must pass
        rendezvous.arrive_and_wait("probe", timeout_s=30)
        out["probe_ok"] = True
    finally:
        rendezvous.DEFAULT_TIMEOUT_S = old
    out["staging_left"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else None
    return out


def tags_job(cfg: dict, save_dir: str) -> dict:
    engine = build(cfg)
    data = batches(3)
    seen = {}
    train(engine, data[:2])
    engine.save_checkpoint(save_dir)                                      # global_step2
    engine.wait_for_checkpoint()  # `latest` is published by the background write
    seen["after_default"] = open(os.path.join(save_dir, "latest")).read()
    train(engine, data[2:])
    engine.save_checkpoint(save_dir, tag="explicit", save_latest=False)
    engine.wait_for_checkpoint()
    seen["after_no_latest"] = open(os.path.join(save_dir, "latest")).read()
    engine.save_checkpoint(save_dir, tag="named")
    engine.wait_for_checkpoint()
    seen["after_named"] = open(os.path.join(save_dir, "latest")).read()
    return seen


def save_before_step_job(cfg: dict, save_dir: str) -> dict:
    """A checkpoint of an engine that never stepped (no optimizer state yet)."""
    engine = build(cfg, "tiny", seed=0)
    engine.save_checkpoint(save_dir)
    return _rank0({"snap": snapshot(engine), "state": state(engine)})


def bad_save_job(cfg: dict, save_dir: str) -> dict:
    """save_checkpoint arguments that must fail on every rank, leaving nothing behind."""
    engine = build(cfg, "tiny", seed=0)
    train(engine, batches(1))
    out = {}
    for name, kwargs in {"reserved": {"client_state": {"global_steps": 5}}, "slash": {"tag": "a/b"},
                         "dot": {"tag": ".hidden"}}.items():
        try:
            engine.save_checkpoint(save_dir, **kwargs)
            out[name] = None
        except Exception as error:  # noqa: BLE001
            out[name] = str(error)
    for empty in (None, ""):   # the same bad argument on every rank: its own type, as upstream (ValueError)
        try:
            engine.save_checkpoint(empty)
        except Exception as error:  # noqa: BLE001
            out[f"empty {empty!r}"] = type(error).__name__
    _dist().barrier()
    out["left"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    return out


def fp32_groups_job(cfg: dict, save_dir: str) -> dict:
    """ZeRO-3's `_set_fp32_optimizer_param_groups()` (upstream's universal-checkpoint tests read the base
    optimizer through it): its `state_dict()` must be this rank's `optimizer_state_dict` of the checkpoint
    file, and `_clear_...()` must take over a `load_state_dict` made in between."""
    dist = _dist()
    engine = build(cfg, model="variety")
    train(engine, batches(2))
    engine.save_checkpoint(save_dir, tag="t")
    rank = dist.get_rank()
    saved = torch.load(os.path.join(save_dir, "t", optim_file(rank)), weights_only=False)["optimizer_state_dict"]
    shapes = torch.load(os.path.join(save_dir, "t", model_files(3, dist.get_world_size())[rank]),
                        weights_only=False)["param_shapes"]
    before = snapshot(engine)
    engine.optimizer._set_fp32_optimizer_param_groups()
    sd = copy.deepcopy(engine.optimizer.optimizer.state_dict())
    file_sd = saved["optimizer_state_dict"]
    same_state = sd["state"].keys() == file_sd["state"].keys() and all(
        torch.equal(sd["state"][g][f], file_sd["state"][g][f]) for g in sd["state"] for f in STATE_FIELDS + ("step",))
    same_flats = [torch.equal(g["params"][0], f) for g, f in zip(engine.optimizer.optimizer.param_groups,
                                                                 saved["fp32_flat_groups"])]
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] * 2
    engine.optimizer.optimizer.load_state_dict(sd)
    engine.optimizer._clear_fp32_optimizer_param_groups()
    after = snapshot(engine)
    doubled = all(torch.equal(after[n]["exp_avg"], before[n]["exp_avg"] * 2) and
                  torch.equal(after[n]["exp_avg_sq"], before[n]["exp_avg_sq"]) and
                  torch.equal(after[n]["fp32"], before[n]["fp32"]) for n in before)
    losses = train(engine, batches(3)[2:])
    return {"same_state": same_state, "same_flats": same_flats, "doubled": doubled, "losses": losses,
            "shapes": engine._get_zero_param_shapes() == shapes, "file_shapes": len(shapes)}
