"""ZeRO side by side: our deepspeed vs the real DeepSpeed 0.19.8, same model, data, optimizer and config.

    python benchmarks/bench_zero.py --quick                      # tiny model, seconds per job
    python benchmarks/bench_zero.py --stages 0,1,2 --dtypes fp32,bf16 --repeats 2
    python benchmarks/bench_zero.py --impls deepspeed --stages 1,2 --steps 5 --warmup 2

Every (impl, stage, dtype) cell is a fresh 2-rank job started with that implementation's
own launcher:

* ``ours``      ``<repo>/.venv/bin/deepspeed --num_gpus 2 bench_zero.py --worker ours ...``
                with ``PYTHONPATH=<repo>`` so the workers import this repository's package;
* ``deepspeed`` ``$DS_VENV/bin/deepspeed --num_gpus 2 bench_zero.py --worker deepspeed ...``
                (``benchmarks/ds_venv.sh`` builds that venv) with ``PYTHONPATH`` removed and
                the job's working directory outside the repository: DeepSpeed's launcher runs
                ``python -m deepspeed.launcher.launch``, and ``-m`` puts the working directory
                first on ``sys.path``, so starting it from the repo root would run *our*
                package under *their* launcher.

Each worker records ``deepspeed.__file__`` and ``__version__`` (shown in the table) and refuses
to run if the wrong package was imported.

Both sides train the GPT of ``examples/gpt/model.py`` (~19.3M parameters: 6 layers, 8 heads,
width 512, block 128, micro batch 4 per rank) from the same seed on the same byte-level
batches of ``examples/gpt/data.py``, with torch's AdamW (config ``optimizer`` with
``torch_adam: true``; DeepSpeed 0.19.8 then builds ``torch.optim.AdamW`` in
``get_optimizer_configuration``), the same ``gradient_clipping``, and the identical
``zero_optimization`` section ``{stage, overlap_comm, reduce_bucket_size,
allgather_bucket_size}``. One thread per rank (2 ranks on 2 cores).

Communication is measured three times:

* **loopback**: the bytes the ranks put on the ``lo`` interface during the timed steps
  (``/proc/net/dev``; every rank runs on this host, so gloo's TCP traffic is all there),
  divided by steps and ranks. That is what was physically sent, whatever a collective's name
  promises: torch's gloo ``reduce_scatter_tensor`` is an all-reduce inside (see
  [Note: gloo's reduce-scatter] in ``deepspeed/comm/exchange.py``). Other traffic on ``lo``
  during the run counts too: keep the machine quiet.

* **neutral**: before ``deepspeed`` is imported the worker wraps the collectives of
  ``torch.distributed`` itself (both implementations end up there on CPU/gloo), so both
  sides are counted by the same code with the same convention: ``bytes`` = the full logical
  message (the whole tensor being all-reduced / reduced / broadcast, the *input* of a
  reduce-scatter, the *output* of an all-gather) and ``wire`` = what one rank sends with a
  bandwidth-optimal ring, ``2(N-1)/N`` of the message for all_reduce and ``(N-1)/N`` for
  reduce-scatter, all-gather, reduce and broadcast. The "vs 2Ψ(N-1)/N" column divides the
  wire bytes by the theoretical ZeRO-1/2 (and DDP) volume of ``2Ψ(N-1)/N`` elements of the
  gradient/communication dtype.
* **own logger**: ours via ``deepspeed.comm.comms_counter``; DeepSpeed via its
  ``comms_logger`` (config section ``{"enabled": true, "prof_all": true}``, read from
  ``deepspeed.comm.comm.comms_logger.comms_dict`` after the timed steps). DeepSpeed's logger
  sizes an all-gather by its *input* (the shard), ours by its output: compare with care.

Jobs are interleaved per repetition (ours, deepspeed, ours, deepspeed, ...) so slow load
drifts of a shared machine hit both alike. A cell whose ``deepspeed.initialize`` raises
``NotImplementedError`` (our ``NotSupportedYet`` is a subclass) is shown as skipped.

Real DeepSpeed on CPU JIT-builds a shared-memory all-reduce op at ``init_distributed`` (about
3 minutes on this machine) and leaves two 69 MB ``/dev/shm/deepspeed_allreduce_buffer_*``
files per job. The driver gives each job a private copy of the op prebuilt by
``ds_venv.sh`` (``$DS_VENV/torch_extensions``) as ``TORCH_EXTENSIONS_DIR`` (a JIT lock shared
with other jobs once hung ``initialize`` for 10 minutes) and deletes the job's
``/dev/shm`` buffers (named after its master port) when the job ends, whatever happened.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_DIR = os.path.join(ROOT, "examples", "gpt")
IMPLS = ("ours", "deepspeed")
DTYPES = ("fp32", "bf16")
FULL_MODEL = dict(n_layer=6, n_head=8, n_embd=512)  # ~19.3M parameters
QUICK_MODEL = dict(n_layer=2, n_head=2, n_embd=64)
MODELS = {"tiny": QUICK_MODEL, "small": dict(n_layer=4, n_head=4, n_embd=256), "full": FULL_MODEL}


def model_config(args) -> dict:
    """--model, else the tiny model with --quick and the full one without."""
    return MODELS[getattr(args, "model", None) or ("tiny" if args.quick else "full")]
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--stages", default="0,1,2", help="comma list of ZeRO stages")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of " + ",".join(DTYPES))
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=2, help="interleaved jobs per cell")
    p.add_argument("--ranks", type=int, default=2, help="processes per job (--num_gpus)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=128, help="sequence length (bytes)")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (both sides)")
    p.add_argument("--overlap-comm", type=int, choices=(0, 1), default=1, help="zero_optimization.overlap_comm")
    p.add_argument("--reduce-bucket-size", type=int, default=5_000_000, help="zero_optimization.reduce_bucket_size")
    p.add_argument("--allgather-bucket-size", type=int, default=5_000_000,
                   help="zero_optimization.allgather_bucket_size")
    p.add_argument("--prefetch-bucket-size", type=int, default=None,
                   help="zero_optimization.stage3_prefetch_bucket_size (0: no prefetch; default: the config default)")
    p.add_argument("--no-comms-logger", action="store_true",
                   help="leave the comms_logger config section out (own-logger columns then stay empty "
                        "for DeepSpeed; the neutral counts are always taken)")
    p.add_argument("--quick", action="store_true", help="tiny model, 1+3 steps, 1 repeat: a smoke test")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="GPT size: tiny (0.1M), small (~3.3M), full (~19.3M; default unless --quick)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ours-venv", default=os.path.join(ROOT, ".venv"))
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--job-timeout", type=int, default=900, help="seconds before a job is killed")
    p.add_argument("--json", default=None, help="also write every job's per-rank results here")
    # Internal: one rank of one job.
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)  # both launchers append --local_rank=N
    if args.quick:
        args.steps, args.warmup, args.repeats = min(args.steps, 3), min(args.warmup, 1), 1
    return args


# ============================================================================ worker side

# Fraction of the full message one rank sends with a bandwidth-optimal ring of N ranks.
WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
}


def _wire_factor(op: str, n: int) -> float:
    return WIRE.get(op, lambda n: (n - 1) / n)(n)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class TorchCollectiveCounter:
    """Counts the collectives of ``torch.distributed`` by wrapping its functions in place.

    Installed before ``deepspeed`` is imported, so a backend that keeps a reference to a
    function at init (DeepSpeed's TorchBackend keeps ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``) keeps the wrapper.
    """

    # op name -> function(args, kwargs) -> (full message bytes, dtype name)
    def __init__(self):
        self.stats: dict[str, dict] = {}
        self.enabled = True

    @staticmethod
    def _arg(args, kwargs, pos, *names):
        if len(args) > pos:
            return args[pos]
        for n in names:
            if n in kwargs:
                return kwargs[n]
        return None

    def _size(self, op, args, kwargs):
        a = lambda pos, *names: self._arg(args, kwargs, pos, *names)  # noqa: E731
        if op in ("all_reduce", "reduce", "broadcast"):
            t = a(0, "tensor")
            return _nbytes(t), t.dtype
        if op in ("reduce_scatter_tensor", "_reduce_scatter_base"):
            t = a(1, "input", "tensor")
            return _nbytes(t), t.dtype
        if op in ("all_gather_into_tensor", "_all_gather_base"):
            t = a(0, "output_tensor")
            return _nbytes(t), t.dtype
        if op == "all_gather":
            ts = a(0, "tensor_list")
            return sum(_nbytes(t) for t in ts), ts[0].dtype
        if op == "reduce_scatter":
            ts = a(1, "input_list")
            return sum(_nbytes(t) for t in ts), ts[0].dtype
        if op == "all_reduce_coalesced":
            ts = a(0, "tensors")
            return sum(_nbytes(t) for t in ts), ts[0].dtype
        if op == "all_to_all_single":
            t = a(1, "input")
            return _nbytes(t), t.dtype
        return 0, None

    def install(self):
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        ops = ("all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "_reduce_scatter_base",
               "all_gather_into_tensor", "_all_gather_base", "all_gather", "reduce_scatter",
               "all_reduce_coalesced", "all_to_all_single")
        for op in ops:
            fn = getattr(c10d, op, None)
            if fn is None:
                continue
            wrapped = self._wrap(op, fn)
            setattr(c10d, op, wrapped)
            if getattr(tdist, op, None) is fn:
                setattr(tdist, op, wrapped)

    def _wrap(self, op, fn):
        import functools

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.enabled:
                try:
                    nbytes, dtype = self._size(op, args, kwargs)
                    group = kwargs.get("group")
                    if group is None and op in ("all_reduce",) and len(args) > 2:
                        group = args[2]
                    import torch.distributed as tdist
                    n = tdist.get_world_size(group) if tdist.is_initialized() else 1
                    s = self.stats.setdefault(op, dict(count=0, bytes=0, wire_bytes=0.0, dtypes={}))
                    s["count"] += 1
                    s["bytes"] += nbytes
                    s["wire_bytes"] += nbytes * _wire_factor(op, n)
                    if dtype is not None:
                        s["dtypes"][str(dtype)] = s["dtypes"].get(str(dtype), 0) + nbytes
                except Exception:  # counting must never break the step
                    pass
            return fn(*args, **kwargs)

        return counted

    def reset(self):
        self.stats.clear()

    def summary(self) -> dict:
        return json.loads(json.dumps(self.stats))


def make_batches(args, rank: int, world: int):
    """(x, y) per step: the same global batches for every job, sliced per rank."""
    import torch
    from data import TextDataset

    ds = TextDataset(block_size=args.block)
    gbs = args.micro_batch * world
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed)).tolist()
    batches = []
    for step in range(args.warmup + args.steps):
        start = step * gbs + rank * args.micro_batch
        xs, ys = zip(*(ds[order[(start + j) % len(order)]] for j in range(args.micro_batch)))
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches


def ds_config(args) -> dict:
    """The one config both implementations get."""
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                   "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage, "overlap_comm": bool(args.overlap_comm),
                              "reduce_bucket_size": args.reduce_bucket_size,
                              "allgather_bucket_size": args.allgather_bucket_size},
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    if getattr(args, "prefetch_bucket_size", None) is not None:  # bench_checkpoint's args have none
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = args.prefetch_bucket_size
    if not args.no_comms_logger:
        cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    return cfg


def own_logger(impl: str, reset: bool = False) -> dict:
    """The implementation's own tally: {op: {count, bytes}} (bytes as that logger sizes them)."""
    if impl == "ours":
        import deepspeed.comm as dist

        if reset:
            dist.comms_counter.reset()
            return {}
        return {op: dict(count=s["count"], bytes=s["bytes"]) for op, s in dist.comms_counter.summary().items()}
    from deepspeed.comm import comm as dcomm  # DeepSpeed: comms_logger.comms_dict[name][msg_size] = [count, ...]

    logger = dcomm.comms_logger
    if reset:
        logger.reset_data()
        return {}
    out = {}
    for name, by_size in logger.comms_dict.items():
        count = sum(v[0] for v in by_size.values())
        out[name] = dict(count=count, bytes=sum(size * v[0] for size, v in by_size.items()))
    return out


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (gc) between steps:
    parameters (or their shards), gradients, masters, optimizer state, persistent buffers.
    Implementation-neutral: it asks no engine what it holds."""
    import gc

    import torch

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # noqa: BLE001 (tensor-likes without storage)
            continue
    return sum(storages.values())


def loopback_tx_bytes() -> int:
    """Bytes sent on the loopback interface since boot (0 where /proc/net/dev has no `lo`)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])
    except OSError:
        pass
    return 0


class PhaseRss:
    """Opt-in (BENCH_RSS_PHASES=1) RSS sampler: the peak resident set seen during each phase of
    the step ('init', 'forward', 'backward', 'step'), read from /proc/self/statm every ~0.5 ms on
    a daemon thread. Diagnostic only: it tells where ru_maxrss is reached, for either impl."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
        try:
            self._mallinfo = ctypes.CDLL("libc.so.6").mallinfo2
            self._mallinfo.restype = MallInfo2
        except (OSError, AttributeError):
            self._mallinfo = None
        self.phase, self.peaks, self.inuse, self._stop = "init", {}, {}, False
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop:
                f.seek(0)
                rss = int(f.read().split()[1]) * self._page / 2**20
                if rss > self.peaks.get(self.phase, 0.0):
                    self.peaks[self.phase] = rss
                if self._mallinfo is not None:
                    m = self._mallinfo()
                    used = (m.uordblks + m.hblkhd) / 2**20  # malloc'd bytes: heap in use + mmapped blocks
                    if used > self.inuse.get(self.phase, 0.0):
                        self.inuse[self.phase] = used
                time.sleep(0.0005)

    def stop(self) -> dict:
        self._stop = True
        self._thread.join()
        return {**{k: round(v, 1) for k, v in self.peaks.items()},
                **{"malloc_" + k: round(v, 1) for k, v in self.inuse.items()}}


def run_worker(args) -> int:
    import torch

    phases = PhaseRss() if os.environ.get("BENCH_RSS_PHASES") == "1" else None
    mark = (lambda name: setattr(phases, "phase", name)) if phases else (lambda name: None)

    counter = TorchCollectiveCounter()
    counter.install()  # before deepspeed is imported
    torch.set_num_threads(args.threads_per_rank)
    sys.path.insert(0, GPT_DIR)
    import deepspeed
    import torch.distributed as tdist

    ds_file = os.path.abspath(deepspeed.__file__)
    mine = ds_file.startswith(ROOT + os.sep)
    if mine != (args.worker == "ours"):
        raise SystemExit(f"worker {args.worker!r} imported the wrong deepspeed: {ds_file}")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    from model import GPT, GPTConfig

    batches = make_batches(args, rank, world)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(block_size=args.block, **model_config(args)))
    n_params = model.num_parameters()
    base = dict(rank=rank, world=world, impl=args.worker, stage=args.stage, dtype=args.dtype,
                ds_file=ds_file, ds_version=deepspeed.__version__, torch_version=torch.__version__,
                params=n_params, threads=torch.get_num_threads())

    def write(result):
        with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
            json.dump({**base, **result}, f)

    try:
        engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                     config=ds_config(args))
    except NotImplementedError as e:
        write(dict(skipped=f"{type(e).__name__}: {e}"))  # the driver finds it; exit 0 on both ranks
        return 0
    inner = getattr(optimizer, "optimizer", None)
    qual = lambda o: f"{type(o).__module__}.{type(o).__qualname__}"  # noqa: E731  (proves torch's AdamW ran)
    base.update(optimizer=qual(optimizer), inner_optimizer=qual(inner) if inner is not None else None,
                param_dtype=str(next(engine.module.parameters()).dtype))
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            tdist.barrier()
            counter.reset()
            own_logger(args.worker, reset=True)
            lo_start = loopback_tx_bytes()
        t0 = time.perf_counter()
        mark("forward")
        loss = engine(x.to(engine.device), y.to(engine.device))
        mark("backward")
        engine.backward(loss)
        mark("step")
        engine.step()
        lv = loss.item()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            losses.append(lv)
    neutral = counter.summary()
    own = own_logger(args.worker)
    counter.enabled = False
    tdist.barrier()
    loopback = loopback_tx_bytes() - lo_start
    del loss
    write(dict(times=times, losses=losses, neutral=neutral, own=own, loopback_bytes=loopback, live_tensor_mb=live_tensor_bytes() / 2**20,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               rss_phases=phases.stop() if phases else None))
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


# ============================================================================ driver side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(args, impl: str, stage: int, dtype: str, out: str) -> list[str]:
    argv = ["--worker", impl, "--stage", str(stage), "--dtype", dtype, "--result-dir", out,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch),
            "--block", str(args.block), "--threads-per-rank", str(args.threads_per_rank), "--clip", str(args.clip),
            "--overlap-comm", str(args.overlap_comm), "--reduce-bucket-size", str(args.reduce_bucket_size),
            "--allgather-bucket-size", str(args.allgather_bucket_size), "--seed", str(args.seed)]
    if args.prefetch_bucket_size is not None:
        argv += ["--prefetch-bucket-size", str(args.prefetch_bucket_size)]
    if args.quick:
        argv.append("--quick")
    if args.model:
        argv += ["--model", args.model]
    if args.no_comms_logger:
        argv.append("--no-comms-logger")
    return argv


def launch(args, impl: str, stage: int, dtype: str, script: str | None = None, argv_of=None) -> dict:
    """One job of `script` (this file by default) with `argv_of(args, impl, stage, dtype, out)` as
    its worker arguments; returns {"ranks": [...]} or {"skipped": msg} or {"error": msg}."""
    script, argv_of = script or os.path.abspath(__file__), argv_of or worker_argv
    venv = args.ours_venv if impl == "ours" else args.ds_venv
    launcher = os.path.join(venv, "bin", "deepspeed")
    if not os.path.exists(launcher):
        return dict(error=f"no launcher at {launcher} (run benchmarks/ds_venv.sh)")
    out = tempfile.mkdtemp(prefix=f"bench_zero_{impl}_s{stage}_{dtype}_")
    ext_dir = os.path.join(out, "torch_extensions")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(OMP_NUM_THREADS=str(args.threads_per_rank), MKL_NUM_THREADS=str(args.threads_per_rank),
               PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=ext_dir)
    if impl == "ours":
        env["PYTHONPATH"] = ROOT
    else:
        prebuilt = os.path.join(args.ds_venv, "torch_extensions")
        if os.path.isdir(prebuilt):  # a private copy: no lock shared with any other job
            shutil.copytree(prebuilt, ext_dir, ignore=shutil.ignore_patterns("lock"))
    cmd = [launcher, "--num_gpus", str(args.ranks), "--master_port", str(port), script,
           *argv_of(args, impl, stage, dtype, out)]
    log_path = os.path.join(out, "launcher.log")
    proc = None
    try:
        with open(log_path, "w") as log:
            # cwd outside the repo (see the module docstring); own session so a timeout can kill the job.
            proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=args.job_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        ranks = []
        for r in range(args.ranks):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        skipped = [r["skipped"] for r in ranks if "skipped" in r]
        if skipped:
            return dict(skipped=skipped[0], ranks=ranks)
        if rc != 0 or len(ranks) != args.ranks:
            with open(log_path) as f:
                tail = "\n".join(f.read().strip().splitlines()[-25:])
            return dict(error=f"exit {rc}:\n{tail}")
        return dict(ranks=ranks)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # DeepSpeed's CPU shm all-reduce buffers: deepspeed_allreduce_buffer_<i>_<addr>_<port>_<rank>
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass
        shutil.rmtree(out, ignore_errors=True)


def per_step(ops: dict, steps: int, key: str) -> dict:
    return {op: s[key] / steps for op, s in sorted(ops.items())}


def aggregate(args, cell: tuple, jobs: list[dict]) -> dict:
    impl, stage, dtype = cell
    row = dict(impl=impl, stage=stage, dtype=dtype)
    skipped = [j["skipped"] for j in jobs if "skipped" in j]
    errors = [j["error"] for j in jobs if "error" in j]
    good = [j["ranks"] for j in jobs if "ranks" in j and "skipped" not in j]
    if not good:
        row["skipped" if skipped else "error"] = (skipped or errors or ["no job ran"])[0]
        return row
    step_times, job_medians = [], []
    for ranks in good:
        slowest = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
        step_times += slowest
        job_medians.append(statistics.median(slowest))
    last = good[-1]
    med = statistics.median(step_times)
    r0 = last[0]
    row.update(
        jobs=len(good), errors=errors, median_step_s=med, job_medians=job_medians,
        tokens_per_s=args.micro_batch * len(last) * args.block / med,
        peak_rss_mb=[max(ranks[i]["peak_rss_mb"] for ranks in good) for i in range(len(last))],
        live_tensor_mb=[max(ranks[i].get("live_tensor_mb", 0) for ranks in good) for i in range(len(last))],
        rss_phases=[r.get("rss_phases") for r in last],
        params=r0["params"], ds_version=r0["ds_version"], ds_file=r0["ds_file"], optimizer=r0["optimizer"],
        inner_optimizer=r0["inner_optimizer"], param_dtype=r0["param_dtype"], threads=r0["threads"],
        neutral_count=per_step(r0["neutral"], args.steps, "count"),
        neutral_bytes=per_step(r0["neutral"], args.steps, "bytes"),
        neutral_wire=sum(s["wire_bytes"] for s in r0["neutral"].values()) / args.steps,
        loopback=r0.get("loopback_bytes", 0) / args.steps / len(last),
        neutral_dtypes={op: s["dtypes"] for op, s in r0["neutral"].items()},
        own_count=per_step(r0["own"], args.steps, "count"), own_bytes=per_step(r0["own"], args.steps, "bytes"),
        final_loss=sum(r["losses"][-1] for r in last) / len(last),
        losses=[sum(r["losses"][i] for r in last) / len(last) for i in range(len(r0["losses"]))],
    )
    return row


def fmt_ops(d: dict, fmt) -> str:
    return "<br>".join(f"{op}: {fmt(v)}" for op, v in d.items()) or "-"


def mb(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def print_tables(rows: list[dict], ranks: int) -> None:
    print("| impl | stage | dtype | median step (s) | job medians (s) | tokens/s | peak RSS / rank (MB) "
          "| live tensors / rank (MB) | collectives / step | bytes / step (message) | wire / rank / step "
          "| vs 2Ψ(N-1)/N | loopback / rank / step | vs 2Ψ(N-1)/N | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['impl']} | {r['stage']} | {r['dtype']} "
        if "skipped" in r:
            print(head + f"| skipped: {r['skipped'][:160]} | | | | | | | | | | | |")
            continue
        if "error" in r:
            msg = r["error"].strip().splitlines()[-1][:160] if r["error"].strip() else "?"
            print(head + f"| FAILED: {msg} | | | | | | | | | | | |")
            continue
        # Ψ elements of the communicated gradient dtype: 2 bytes under bf16, 4 under fp32.
        elt = 2 if r["dtype"] == "bf16" else 4
        ideal = 2 * r["params"] * elt * (ranks - 1) / ranks
        rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mb"])
        ratio = f"{r['neutral_wire'] / ideal:.2f}x" if ideal else "-"   # one rank: nothing to send
        lo_ratio = f"{r['loopback'] / ideal:.2f}x" if ideal else "-"
        live = " / ".join(f"{m:.1f}" for m in r["live_tensor_mb"])
        spread = ", ".join(f"{m:.3f}" for m in r["job_medians"])
        print(head + f"| {r['median_step_s']:.3f} | {spread} | {r['tokens_per_s']:,.0f} | {rss} | {live} "
              f"| {fmt_ops(r['neutral_count'], lambda v: f'{v:g}')} | {fmt_ops(r['neutral_bytes'], mb)} "
              f"| {mb(r['neutral_wire'])} | {ratio} | {mb(r['loopback'])} | {lo_ratio} | {r['final_loss']:.4f} |")
    traced = [r for r in rows if r.get("rss_phases") and r["rss_phases"][0]]
    if traced:
        print("\nPeak RSS per phase, MB (BENCH_RSS_PHASES=1; last job, rank 0 / rank 1):\n")
        keys = ("init", "forward", "backward", "step")
        print("| impl | stage | dtype | " + " | ".join(keys) + " | " + " | ".join(f"malloc'd, {k}" for k in keys) + " |")
        print("|---|---|---|" + "---|" * 2 * len(keys))
        for r in traced:
            cells = [" / ".join(f"{p.get(k, 0):.0f}" for p in r["rss_phases"]) for k in keys]
            cells += [" / ".join(f"{p.get('malloc_' + k, 0):.0f}" for p in r["rss_phases"]) for k in keys]
            print(f"| {r['impl']} | {r['stage']} | {r['dtype']} | " + " | ".join(cells) + " |")
    print("\nOwn comms loggers (rank 0, per step; DeepSpeed sizes all-gathers by their input shard):\n")
    print("| impl | stage | dtype | deepspeed | optimizer (inner) | param dtype | collectives / step | bytes / step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        print(f"| {r['impl']} | {r['stage']} | {r['dtype']} | {r['ds_version']} `{r['ds_file']}` "
              f"| {r['optimizer']} ({r['inner_optimizer']}) | {r['param_dtype']} "
              f"| {fmt_ops(r['own_count'], lambda v: f'{v:g}')} | {fmt_ops(r['own_bytes'], mb)} |")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # so launch()'s finally kills the job and cleans /dev/shm


def driver(args) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    bad = (set(impls) - set(IMPLS)) | (set(dtypes) - set(DTYPES)) | {str(s) for s in stages if s not in (0, 1, 2, 3)}
    if bad:
        sys.exit(f"unknown impls/dtypes/stages: {sorted(bad)}")
    model_cfg = model_config(args)
    print(f"model {model_cfg} block {args.block}, micro batch {args.micro_batch} x {args.ranks} ranks x "
          f"{args.threads_per_rank} thread(s); {args.warmup} warmup + {args.steps} timed steps x {args.repeats} "
          f"repeats; clip {args.clip}; overlap_comm {bool(args.overlap_comm)}, reduce/allgather bucket "
          f"{args.reduce_bucket_size:g}/{args.allgather_bucket_size:g}; cpus {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    cells = [(impl, s, d) for s in stages for d in dtypes for impl in impls]
    jobs: dict[tuple, list[dict]] = {c: [] for c in cells}
    for rep in range(args.repeats):
        for cell in cells:
            if any("skipped" in j for j in jobs[cell]) or (jobs[cell] and all("error" in j for j in jobs[cell])):
                continue  # skipped or failed once: do not spend more time on it
            t0 = time.perf_counter()
            load = os.getloadavg()[0]
            res = launch(args, *cell)
            jobs[cell].append(res)
            state = "skipped" if "skipped" in res else "FAILED" if "error" in res else "ok"
            print(f"[repeat {rep + 1}/{args.repeats}] {cell[0]} stage {cell[1]} {cell[2]}: {state} "
                  f"in {time.perf_counter() - t0:.1f}s (load before {load:.2f})", flush=True)
            if "error" in res:
                print(res["error"], file=sys.stderr, flush=True)
    rows = [aggregate(args, c, jobs[c]) for c in cells]
    params = next((r["params"] for r in rows if "params" in r), 0)
    ideal = 2 * params * (args.ranks - 1) / args.ranks  # elements
    print(f"\nparameters Ψ = {params:,}; 2Ψ(N-1)/N = {ideal:,.0f} elements (fp32 {mb(4 * ideal)}, "
          f"bf16 {mb(2 * ideal)}); load now {os.getloadavg()[0]:.2f}\n")
    print_tables(rows, args.ranks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, jobs={f"{c[0]}/{c[1]}/{c[2]}": v for c, v in jobs.items()}),
                      f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


def main(argv=None, parse_args=parse_args, run_worker=run_worker, driver=driver) -> int:
    """Worker or driver, by `--worker` (shared with bench_checkpoint.py)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        try:
            return run_worker(args)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)  # do not hang in a collective the other rank never joins
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
