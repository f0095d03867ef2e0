"""Checkpoint save/load time and size side by side: our deepspeed vs the real DeepSpeed 0.19.8.

    python benchmarks/bench_checkpoint.py --stages 0,1,2 --dtypes fp32 --repeats 3
    python benchmarks/bench_checkpoint.py --quick                        # tiny model, a smoke test
    python benchmarks/bench_checkpoint.py --impls ours --stages 2 --profile 20

Every (impl, stage, dtype) cell is a fresh 2-rank job started by that implementation's own
launcher, with the plumbing of ``bench_zero.py`` (its ``launch``: ``PYTHONPATH=<repo>`` for
ours; for DeepSpeed ``PYTHONPATH`` removed and the job's cwd outside the repository, a private
copy of the prebuilt shm op as ``TORCH_EXTENSIONS_DIR``, the job's ``/dev/shm`` buffers deleted
afterwards), the same GPT (``examples/gpt/model.py``, ~19.3M parameters), batches, torch AdamW
(``torch_adam: true``) and config (``bench_zero.ds_config``, comms logger off). The worker
refuses to run if it imported the wrong ``deepspeed``.

In each job:

1. initialize and train ``--train-steps`` (2) steps, so Adam's state exists;
2. ``engine.save_checkpoint(dir, tag=f"t{i}")`` ``--repeats`` times into new tags (a barrier
   before each start of the clock; wall time taken on every rank, the slowest rank counts;
   the table shows the median; earlier tags are deleted untimed, the last one is kept).
   "training blocked" is the time save_checkpoint takes to return; "until published" adds
   ``engine.wait_for_checkpoint()`` (ours: until every file is fsynced and rank 0 has renamed
   the tag and written ``latest``; the same as blocked without a background save; DeepSpeed has
   no wait and does not fsync). "CPU s" beside each: the process's CPU seconds over the same
   span (every thread, the background writer's too; the slowest rank). ``ours`` is the default
   (published on return, fsynced in the background), ``ours-async`` ours with
   ``checkpoint.async_save: true`` (written in the background too);
3. the sizes of the files of the last tag directory (``rng_state_*.pt`` listed separately;
   ``latest`` and ours' copy of ``zero_to_fp32.py`` lie in the save dir, not in the tag);
4. the saving engine trains on batch 2 and computes the loss of batch 3 (reference losses);
5. a fresh engine (model from another seed) in the same job: ``load_checkpoint(dir, tag)``
   ``--repeats`` times (median of the slowest rank), then the same step on batch 2 and the
   loss of batch 3. The loss of batch 2 checks the loaded weights, the loss of batch 3 (after
   one optimizer step) also the loaded Adam state; the table shows max |diff| over ranks.

Theoretical bytes, Ψ parameters: fp32: module 4Ψ + fp32 master 4Ψ (stage > 0 only; at stage 0
the fp32 module is the master) + Adam's two moments 8Ψ; bf16: module 2Ψ + master 4Ψ + 8Ψ;
stage 3: no module weights (the model-states files hold placeholders).

Checkpoints go to the job's temp dir under ``$TMPDIR`` (local disk here), removed afterwards.
Loads read files just written, so they come from the page cache on both sides. Cells run in
the order (stage, dtype, impl), ``--jobs`` times, interleaved as in ``bench_zero.py``.
``--profile N`` adds one untimed save and load under cProfile on rank 0 and prints its top N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import bench_zero as bz

DTYPES = bz.DTYPES
IMPLS = ("ours", "ours-async", "deepspeed")  # ours-async: ours with checkpoint.async_save true


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--stages", default="0,1,2")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per job (median)")
    p.add_argument("--jobs", type=int, default=1, help="interleaved jobs per cell")
    p.add_argument("--train-steps", type=int, default=2, help="steps before the first save")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="tiny model")
    p.add_argument("--profile", type=int, default=0, help="print the top N of a cProfile'd save and load")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ours-venv", default=os.path.join(bz.ROOT, ".venv"))
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--job-timeout", type=int, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=bz.IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--async-save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    # What bench_zero.ds_config / make_batches read, fixed here.
    p.set_defaults(overlap_comm=1, reduce_bucket_size=5_000_000, allgather_bucket_size=5_000_000,
                   no_comms_logger=True, warmup=0)
    args, _ = p.parse_known_args(argv)  # both launchers append --local_rank=N
    args.steps = args.train_steps + 2
    return args


# ============================================================================ worker side


def run_worker(args) -> int:
    import cProfile
    import io
    import pstats

    import torch

    torch.set_num_threads(args.threads_per_rank)
    sys.path.insert(0, bz.GPT_DIR)
    import deepspeed
    import torch.distributed as tdist

    ds_file = os.path.abspath(deepspeed.__file__)
    if ds_file.startswith(bz.ROOT + os.sep) != (args.worker == "ours"):
        raise SystemExit(f"worker {args.worker!r} imported the wrong deepspeed: {ds_file}")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    from model import GPT, GPTConfig

    batches = bz.make_batches(args, rank, world)
    config = bz.ds_config(args)
    if args.async_save:
        config["checkpoint"] = {"async_save": True}

    def build(seed):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=args.block, **bz.model_config(args)))
        count = model.num_parameters()  # before initialize: ZeRO-3 leaves released placeholders
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine, count

    def step(engine, i, train=True):
        x, y = batches[i]
        loss = engine(x.to(engine.device), y.to(engine.device))
        if train:
            engine.backward(loss)
            engine.step()
        return loss.item()

    def timed(fn):
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def profiled(fn):
        if rank != 0:
            fn()
            return None
        prof = cProfile.Profile()
        prof.runcall(fn)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.profile)
        return out.getvalue()

    engine, n_params = build(args.seed)
    for i in range(args.train_steps):
        step(engine, i)
    save_dir = os.path.join(args.result_dir, "ckpt")
    save_times, durable_times, save_cpu, durable_cpu = [], [], [], []
    wait = getattr(engine, "wait_for_checkpoint", lambda: None)  # ours: the background write, published
    for i in range(args.repeats):
        c0 = time.process_time()  # this process's CPU seconds, every thread (the writer's too)
        save_times.append(timed(lambda: engine.save_checkpoint(save_dir, tag=f"t{i}")))
        save_cpu.append(time.process_time() - c0)
        t0 = time.perf_counter()
        wait()
        durable_times.append(save_times[-1] + time.perf_counter() - t0)
        durable_cpu.append(time.process_time() - c0)
        tdist.barrier()
        if rank == 0 and i > 0:
            shutil.rmtree(os.path.join(save_dir, f"t{i - 1}"))
    tag = f"t{args.repeats - 1}"
    prof_save = prof_load = None
    if args.profile:
        prof_save = profiled(lambda: (engine.save_checkpoint(save_dir, tag="prof", save_latest=False), wait()))
        tdist.barrier()
    tag_dir = os.path.join(save_dir, tag)
    files = {os.path.relpath(os.path.join(d, f), tag_dir): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(tag_dir) for f in fs}
    outside = sorted(f for f in os.listdir(save_dir) if not os.path.isdir(os.path.join(save_dir, f)))
    ref = [step(engine, args.train_steps), step(engine, args.train_steps + 1, train=False)]
    del engine

    engine, _ = build(args.seed + 1)
    load_times = []
    for _ in range(args.repeats):
        result = {}
        load_times.append(timed(lambda: result.update(out=engine.load_checkpoint(save_dir, tag=tag))))
        if result["out"][0] is None:
            raise RuntimeError(f"load_checkpoint({save_dir}, {tag}) returned {result['out']}")
    if args.profile:
        tdist.barrier()
        prof_load = profiled(lambda: engine.load_checkpoint(save_dir, tag=tag))
    got = [step(engine, args.train_steps), step(engine, args.train_steps + 1, train=False)]
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, ds_file=ds_file, ds_version=deepspeed.__version__, params=n_params,
                       save_times=save_times, durable_times=durable_times, load_times=load_times,
                       save_cpu=save_cpu, durable_cpu=durable_cpu,
                       files=files, outside=outside,
                       ref=ref, got=got, prof_save=prof_save, prof_load=prof_load), f)
    tdist.barrier()
    if rank == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    tdist.destroy_process_group()
    return 0


# ============================================================================ driver side


def worker_argv(args, impl: str, stage: int, dtype: str, out: str) -> list[str]:
    argv = ["--worker", impl, "--stage", str(stage), "--dtype", dtype, "--result-dir", out,
            "--repeats", str(args.repeats), "--train-steps", str(args.train_steps),
            "--micro-batch", str(args.micro_batch), "--block", str(args.block),
            "--threads-per-rank", str(args.threads_per_rank), "--clip", str(args.clip), "--seed", str(args.seed),
            "--profile", str(args.profile)]
    return argv + (["--quick"] if args.quick else [])


def launch(args, impl: str, stage: int, dtype: str) -> dict:
    real = "ours" if impl == "ours-async" else impl
    extra = ["--async-save"] if impl == "ours-async" else []
    return bz.launch(args, real, stage, dtype, script=os.path.abspath(__file__),
                     argv_of=lambda *a: worker_argv(*a) + extra)


def theoretical(params: int, stage: int, dtype: str) -> int:
    """Module weights (none at stage 3: placeholders), fp32 masters (stage > 0) and Adam's two moments."""
    module = 0 if stage == 3 else (2 if dtype == "bf16" else 4)
    master = 4 if (stage > 0 or dtype == "bf16") else 0
    return (module + master + 8) * params


def size(b: float) -> str:
    return f"{b / 1e6:,.1f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} KB"


def aggregate(cell: tuple, jobs: list[dict]) -> dict:
    impl, stage, dtype = cell
    row = dict(impl=impl, stage=stage, dtype=dtype)
    good = [j["ranks"] for j in jobs if "ranks" in j]
    if not good:
        row["error"] = next((j.get("error") or j.get("skipped") for j in jobs), "no job ran")
        return row

    def slowest(key):  # per repeat, the slowest rank's time
        return [max(r[key][i] for r in ranks) for ranks in good for i in range(len(ranks[0][key]))]

    r0 = good[-1][0]
    files = r0["files"]
    rng = {f: s for f, s in files.items() if os.path.basename(f).startswith("rng_state")}
    row.update(save=slowest("save_times"), durable=slowest("durable_times"), load=slowest("load_times"),
               save_cpu=slowest("save_cpu"), durable_cpu=slowest("durable_cpu"),
               files=files, rng=rng,
               total=sum(files.values()), params=r0["params"], outside=r0["outside"],
               ds=f"{r0['ds_version']} `{r0['ds_file']}`", prof=(r0["prof_save"], r0["prof_load"]),
               diff=[max(abs(r["ref"][k] - r["got"][k]) for ranks in good for r in ranks) for k in (0, 1)],
               loss=[r0["ref"][0], r0["ref"][1]])
    return row


def print_tables(rows: list[dict]) -> None:
    print("| impl | stage | dtype | save: training blocked s (median) | CPU s | save: until published s (median) "
          "| CPU s | load s (median) | tag bytes | bytes / theoretical | next-step loss diff (weights / after +1 step) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['impl']} | {r['stage']} | {r['dtype']} "
        if "error" in r:
            print(head + f"| FAILED: {r['error'].strip().splitlines()[-1][:160]} | | | | | |")
            continue
        rng = f" (of which rng_state: {len(r['rng'])} x {size(max(r['rng'].values()))})" if r["rng"] else ""
        print(head + f"| {statistics.median(r['save']):.3f} | {statistics.median(r['save_cpu']):.3f} "
              f"| {statistics.median(r['durable']):.3f} | {statistics.median(r['durable_cpu']):.3f} "
              f"| {statistics.median(r['load']):.3f} "
              f"| {r['total']:,} B{rng} | {r['total'] / theoretical(r['params'], r['stage'], r['dtype']):.3f} "
              f"| {r['diff'][0]:.3g} / {r['diff'][1]:.3g} |")
    print("\n| impl | stage | dtype | save blocked s (all) | until published s (all) | load s (all) "
          "| files in the tag dir | save dir extras | deepspeed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" not in r:
            fl = "<br>".join(f"{f}: {s:,}" for f, s in sorted(r["files"].items()))
            print(f"| {r['impl']} | {r['stage']} | {r['dtype']} | {', '.join(f'{t:.3f}' for t in r['save'])} "
                  f"| {', '.join(f'{t:.3f}' for t in r['durable'])} "
                  f"| {', '.join(f'{t:.3f}' for t in r['load'])} | {fl} | {', '.join(r['outside'])} | {r['ds']} |")
    for r in rows:
        for what, text in zip(("save", "load"), r.get("prof") or ()):
            if text:
                print(f"\n### cProfile, {r['impl']} stage {r['stage']} {r['dtype']}, {what} (rank 0)\n```\n{text}```")


def driver(args) -> int:
    import signal

    signal.signal(signal.SIGTERM, bz._interrupt)
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    bad = (set(impls) - set(IMPLS)) | (set(dtypes) - set(DTYPES)) | {str(s) for s in stages if s not in (0, 1, 2, 3)}
    if bad:
        sys.exit(f"unknown impls/dtypes/stages: {sorted(bad)}")
    print(f"model {bz.model_config(args)} block {args.block}, micro batch "
          f"{args.micro_batch} x {args.ranks} ranks; {args.train_steps} steps, then {args.repeats} saves + "
          f"{args.repeats} loads per job, {args.jobs} job(s) per cell; cpus {os.cpu_count()}, "
          f"load {os.getloadavg()}", flush=True)
    cells = [(impl, s, d) for s in stages for d in dtypes for impl in impls]
    jobs: dict[tuple, list[dict]] = {c: [] for c in cells}
    for rep in range(args.jobs):
        for cell in cells:
            if jobs[cell] and all("ranks" not in j for j in jobs[cell]):
                continue  # failed or skipped once
            t0, load = time.perf_counter(), os.getloadavg()[0]
            res = launch(args, *cell)
            jobs[cell].append(res)
            state = "ok" if "ranks" in res else "skipped" if "skipped" in res else "FAILED"
            print(f"[job {rep + 1}/{args.jobs}] {cell[0]} stage {cell[1]} {cell[2]}: {state} in "
                  f"{time.perf_counter() - t0:.1f}s (load before {load:.2f})", flush=True)
            if "error" in res:
                print(res["error"], file=sys.stderr, flush=True)
    rows = [aggregate(c, jobs[c]) for c in cells]
    params = next((r["params"] for r in rows if "params" in r), 0)
    print(f"\nparameters Ψ = {params:,}; theoretical fp32 stage 0 12Ψ = {12 * params:,} B, stage 1-2 16Ψ = "
          f"{16 * params:,} B; load now {os.getloadavg()}\n")
    print_tables(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


def main(argv=None) -> int:
    return bz.main(argv, parse_args=parse_args, run_worker=run_worker, driver=driver)


if __name__ == "__main__":
    sys.exit(main())
