"""Ulysses sequence parallelism / ALST: longest sequence within a per-rank activation budget, and step time.

    python benchmarks/bench_sequence_parallel.py --quick                 # smoke test, ~2 minutes
    python benchmarks/bench_sequence_parallel.py                         # ours + DeepSpeed 0.19.8, SP 1/2/4
    python benchmarks/bench_sequence_parallel.py --impls deepspeed --sp 2 --tiled 1 --json /tmp/sp.json

Both implementations are driven by this one script through upstream's ALST API, unchanged:
``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)`` (returns the ``mpu``
handed to ``deepspeed.initialize``), ``UlyssesSPDataLoaderAdapter`` (shards each sample along
the sequence and pre-shifts ``labels`` into ``shift_labels``), the tutorial's differentiable
token-weighted loss aggregation over the sequence-parallel group, and, with ``--tiled 1``,
``TiledMLP`` patched into ``LlamaMLP.forward`` (``num_shards = ceil(seqlen / hidden)``, agreed
by an all-reduce MAX, as upstream's docstring) plus ``TiledFusedLogitsLoss`` over ``lm_head``
(the full ``[seq, vocab]`` logits are never held). Jobs are started as in ``bench_zero.py``:
ours with ``<ours-venv>/bin/deepspeed`` and ``PYTHONPATH=<repo>``, DeepSpeed 0.19.8 with
``$DS_VENV/bin/deepspeed`` (``benchmarks/ds_venv.sh``; transformers installed there too) from a
directory outside the repo, with a private ``TORCH_EXTENSIONS_DIR``; its
``/dev/shm/deepspeed_allreduce_buffer_*`` files are removed after each job. World = SP.

Model: a tiny Llama from a local ``LlamaConfig`` (no hub): hidden 128, 2 layers, 8 heads, 4 kv
heads, intermediate 512, vocab 8192 (so the logits weigh as in a real LLM), fp32, sdpa attention
(causal, no mask), micro batch 1, ZeRO stage 0, ``torch.optim.AdamW``. One thread per rank.

Memory is *counted*, not sampled from the allocator (CPU has no ``max_memory_allocated``):
``torch.autograd.graph.saved_tensors_hooks`` wrap forward and backward, each tensor autograd
keeps is charged once per storage (views of one storage share the charge, parameters are
not charged) until the graph releases it, and the peak of the live total is the step's
activation memory. That includes what a tiled function saves and what its recompute saves
inside backward. Each step also records the peak up to the end of the loss's forward
(``fwd_peak``) and what is still held then (``fwd_live``, the bytes kept for backward), so the
JSON shows whether a step peaks in forward or in backward. Peak RSS (psutil, sampled every 2 ms
during the step) is shown beside it.

(a) For each (impl, SP, tiled) the longest global sequence whose step (forward + backward +
optimizer step) keeps every rank's counted activation peak within ``--budget-mib``: lengths
double from ``--start`` until one is over the budget (a candidate over budget after forward
skips its backward), then bisect to ``--granularity`` tokens; the result is trained once more
for the RSS column. (b) Step time at ``--time-seq`` global tokens (the same for every SP):
wall seconds of the slowest rank and CPU seconds summed over ranks, median of ``--steps``
after ``--warmup``; the counted activation per rank at that length gives the 1/SP ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_zero as bz  # noqa: E402  (launch, free_port: the shared two-venv job runner)

IMPLS = ("ours", "deepspeed")
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=512, vocab_size=8192)
QUICK_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=256, vocab_size=2048)
MIB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--sp", default="1,2,4", help="comma list of sequence-parallel sizes (world = sp)")
    p.add_argument("--tiled", default="0,1", help="comma list: 0 plain MLP + full logits, 1 TiledMLP + tiled loss")
    p.add_argument("--budget-mib", type=float, default=32.0, help="per-rank counted activation budget")
    p.add_argument("--start", type=int, default=512, help="first global length of the doubling search")
    p.add_argument("--granularity", type=int, default=256, help="bisection stops at this many tokens")
    p.add_argument("--max-seq", type=int, default=32768, help="search ceiling (global tokens)")
    p.add_argument("--time-seq", type=int, default=2048, help="global tokens per step for the timing")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="small model and budget: a smoke test")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ours-venv", default=os.path.join(bz.ROOT, ".venv"))
    p.add_argument("--ds-venv", default=os.environ.get("DS_VENV", "/tmp/ds-venv"))
    p.add_argument("--job-timeout", type=int, default=1800, help="seconds before a job is killed")
    p.add_argument("--json", default=None, help="also write every job's per-rank results here")
    p.add_argument("--from-json", default=None, help="comma list of --json files: print their rows as one table")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--sp-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tiled-on", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)  # both launchers append --local_rank=N
    if args.quick:
        args.budget_mib, args.start, args.granularity = min(args.budget_mib, 4.0), 128, 64
        args.max_seq, args.time_seq, args.steps, args.warmup = min(args.max_seq, 4096), 512, 1, 1
    return args


# ============================================================================ worker side


class SavedBytes:
    """Live and peak bytes of the tensors autograd keeps for backward, one charge per storage.

    Each packed tensor is wrapped; the wrapper's release (when autograd frees the saved
    variable, after its node ran backward or with the graph) drops the storage's reference.
    Parameters are not activations and are never charged."""

    def __init__(self, params):
        import torch
        self.tensor_type = torch.Tensor
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list] = {}
        self.live = self.peak = 0
        self._hooks = None

    def reset(self):
        self.peak = self.live

    def _pack(self, t):
        if not isinstance(t, self.tensor_type) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_ptrs or storage.nbytes() == 0:
            return t
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, storage.nbytes(), tuple(t.shape)]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        # detached: a saved output holding its own grad_fn would be a cycle through C++ that keeps an
        # unused graph (a forward over budget, never backpropagated) alive forever
        return _Held(self, key, t.detach())

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _release(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __enter__(self):
        import torch
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Held:
    __slots__ = ("owner", "key", "t")

    def __init__(self, owner, key, t):
        self.owner, self.key, self.t = owner, key, t

    def __del__(self):
        self.owner._release(self.key)


class RssPeak:
    """Peak resident set size of this process while it is running (psutil, every 2 ms)."""

    def __init__(self):
        import psutil
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def patch_tiled_mlp(TiledMLP, dist):
    """Upstream's documented TiledMLP monkey patch of LlamaMLP.forward."""
    import torch
    from transformers.models.llama import modeling_llama

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self, x):
        bs, seqlen, hidden = x.shape
        num_shards = torch.tensor(math.ceil(seqlen / hidden))
        dist.all_reduce(num_shards, op=dist.ReduceOp.MAX)  # every rank runs the same number of shards
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, int(num_shards.item()), compute_params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward


class Job:
    """One rank: the model, the engine and one training step at a given global length."""

    def __init__(self, args):
        import torch
        import deepspeed
        import deepspeed.comm as dist
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch, self.dist, self.args = torch, dist, args
        self.sp, self.tiled = args.sp_size, bool(args.tiled_on)
        ulysses_sp = None
        if self.sp > 1 or self.tiled:  # plain SP=1 needs only the engine
            from deepspeed.runtime.sequence_parallel import ulysses_sp
        self.ulysses = ulysses_sp
        shape = QUICK_MODEL if args.quick else MODEL
        cfg = LlamaConfig(**shape, max_position_embeddings=max(args.max_seq, args.time_seq) * 2,
                          attn_implementation="sdpa", tie_word_embeddings=False)
        if self.tiled:
            patch_tiled_mlp(ulysses_sp.TiledMLP, dist)
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(cfg)
        mpu = None
        if self.sp > 1:
            mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=self.sp,
                micro_batch_size=1, seq_length_is_variable=True)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 0}, "sequence_parallel_size": self.sp}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
        self.model, self.vocab, self.hidden = model, cfg.vocab_size, cfg.hidden_size
        if self.sp > 1:
            from deepspeed.utils import groups
            self.sp_group = groups._get_sequence_parallel_group()
            self.sp_rank = groups._get_sequence_parallel_rank()
            assert groups._get_sequence_parallel_world_size() == self.sp
        self.counter = SavedBytes(model.parameters())

    # -- data
    def batch(self, seq: int) -> dict:
        torch = self.torch
        g = torch.Generator().manual_seed(self.args.seed + seq)
        samples = [torch.randint(0, self.vocab, (seq, ), generator=g) for _ in range(self.sp)]
        if self.sp == 1:
            ids = samples[0].unsqueeze(0)
            labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
            return dict(input_ids=ids, position_ids=torch.arange(seq).unsqueeze(0), shift_labels=labels)
        # every rank's loader yields its own sample; the adapter deals sample k's shards to the group
        mine = samples[self.dist.get_rank() % self.sp].unsqueeze(0)

        def collate(items):
            return dict(input_ids=mine, position_ids=torch.arange(seq).unsqueeze(0), labels=mine.clone())

        dl = torch.utils.data.DataLoader([0], batch_size=1, collate_fn=collate)
        dl = self.ulysses.UlyssesSPDataLoaderAdapter(dl, sp_rank=self.sp_rank, sp_group=self.sp_group,
                                                     sp_world_size=self.sp, device=torch.device("cpu"))
        return next(iter(dl))

    # -- loss (upstream's ALST recipe)
    def loss(self, batch: dict):
        torch, F = self.torch, self.torch.nn.functional
        labels = batch["shift_labels"]
        good = (labels != -100).sum()
        if self.tiled:
            hidden = self.engine.module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                              use_cache=False).last_hidden_state
            lm_head = self.engine.module.lm_head

            def loss_fn(head, x, y):
                return F.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")

            shards = max(1, math.ceil(labels.shape[1] / self.hidden))
            total = self.ulysses.TiledFusedLogitsLoss.apply(loss_fn, lm_head, hidden, labels, None, shards,
                                                            [lm_head.weight], "sum")
            loss = total / good.clamp(min=1)
        else:
            out = self.engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            loss = self.model.loss_function(logits=out.logits, labels=None, shift_labels=labels,
                                            vocab_size=self.vocab)
        if self.sp == 1:
            return loss
        losses = torch.distributed.nn.functional.all_gather(loss, group=self.sp_group)
        goods = torch.distributed.nn.functional.all_gather(good, group=self.sp_group)
        return sum(losses[r] * goods[r] for r in range(self.sp)) / max(sum(goods), 1)

    def agree_max(self, value: float) -> float:
        t = self.torch.tensor([float(value)], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def step(self, seq: int, budget: float | None = None) -> dict:
        """One step at `seq` global tokens; with a budget, a forward already over it skips backward."""
        batch = self.batch(seq)
        self.counter.reset()
        rss = RssPeak()
        c0, w0 = time.process_time(), time.perf_counter()
        trained = True
        with rss, self.counter:
            loss = self.loss(batch)
            fwd_peak, fwd_live = self.counter.peak, self.counter.live
            if budget is not None and self.agree_max(self.counter.peak) > budget:
                trained = False
                del loss
                for p in self.model.parameters():  # the tiled loss already wrote lm_head's gradient
                    p.grad = None
            else:
                self.engine.backward(loss)
                loss_value = float(loss.detach())
                del loss
        if trained:
            self.engine.step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        assert self.counter.live == 0 or not trained, (
            f"{self.counter.live} saved bytes still held after backward: {list(self.counter.refs.values())[:8]}")
        out = dict(seq=seq, peak=self.counter.peak, peak_max=self.agree_max(self.counter.peak), trained=trained,
                   fwd_peak=fwd_peak, fwd_live=fwd_live,
                   rss=rss.peak, wall=wall, cpu=cpu)
        if trained:
            out["loss"] = loss_value
        return out

    def search(self) -> dict:
        """Double from --start while the step fits the budget, then bisect to --granularity."""
        a, budget = self.args, self.args.budget_mib * MIB
        g = math.lcm(a.granularity, self.sp)
        log, lo, hi, seq = [], 0, None, a.start
        while seq <= a.max_seq:
            r = self.step(seq, budget)
            log.append(r)
            if r["trained"] and r["peak_max"] <= budget:
                lo, seq = seq, seq * 2
            else:
                hi = seq
                break
        if hi is None:
            return dict(max_seq=lo, capped=True, log=log)
        while hi - lo > g:
            mid = (lo + hi) // 2 // g * g
            if mid <= lo:
                break
            r = self.step(mid, budget)
            log.append(r)
            if r["trained"] and r["peak_max"] <= budget:
                lo = mid
            else:
                hi = mid
        return dict(max_seq=lo, capped=False, log=log)


def run_worker(args) -> int:
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(args.result_dir, f"rank{rank}.json")
    result: dict = dict(rank=rank)
    try:
        import torch
        torch.set_num_threads(args.threads_per_rank)
        import deepspeed
        result.update(file=deepspeed.__file__, version=deepspeed.__version__)
        ours = os.path.realpath(deepspeed.__file__).startswith(os.path.realpath(bz.ROOT) + os.sep)
        if ours != (args.worker == "ours"):
            raise RuntimeError(f"--worker {args.worker} imported {deepspeed.__file__}")
        deepspeed.init_distributed(dist_backend="gloo")
        job = Job(args)
        search = job.search()
        result["search"] = search
        if search["max_seq"]:
            result["at_max"] = job.step(search["max_seq"])
        timed = [job.step(args.time_seq) for _ in range(args.warmup + args.steps)][args.warmup:]
        result["timed"] = timed
    except Exception as e:  # recorded as the result: an upstream failure is a finding
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], file=sys.stderr, flush=True)
    with open(path, "w") as f:
        json.dump(result, f)
    return 0


# ============================================================================ driver side


def worker_argv(args, impl: str, sp: int, tiled: int, out: str) -> list[str]:
    argv = ["--worker", impl, "--sp-size", str(sp), "--tiled-on", str(tiled), "--result-dir", out,
            "--budget-mib", str(args.budget_mib), "--start", str(args.start), "--granularity", str(args.granularity),
            "--max-seq", str(args.max_seq), "--time-seq", str(args.time_seq), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads-per-rank", str(args.threads_per_rank), "--seed", str(args.seed)]
    return argv + (["--quick"] if args.quick else [])


def launch(args, impl: str, sp: int, tiled: int) -> dict:
    args.ranks = sp
    return bz.launch(args, impl, sp, tiled, script=os.path.abspath(__file__), argv_of=worker_argv)


def summarize(impl: str, sp: int, tiled: int, job: dict, budget: float) -> dict:
    row = dict(impl=impl, sp=sp, tiled=tiled)
    ranks = job.get("ranks", [])
    errors = [r["error"] for r in ranks if "error" in r]
    if "error" in job or errors or not ranks:
        row["error"] = errors[0] if errors else job.get("error", job.get("skipped", "no result"))
        return row
    r0 = ranks[0]
    row.update(version=r0["version"], max_seq=r0["search"]["max_seq"], capped=r0["search"]["capped"],
               search=[(s["seq"], round(s["peak_max"] / MIB, 2), s["trained"] and s["peak_max"] <= budget)
                       for s in r0["search"]["log"]])
    if "at_max" in r0:
        row["act_at_max"] = max(r["at_max"]["peak"] for r in ranks)
        row["rss_at_max"] = max(r["at_max"]["rss"] for r in ranks)
    steps = list(zip(*(r["timed"] for r in ranks)))  # per timed step: one dict per rank
    row["act_at_T"] = max(r["timed"][-1]["peak"] for r in ranks)
    row["wall"] = statistics.median(max(d["wall"] for d in step) for step in steps)
    row["cpu"] = statistics.median(sum(d["cpu"] for d in step) for step in steps)
    row["loss"] = r0["timed"][-1].get("loss")
    return row


def print_tables(rows: list[dict], args) -> None:
    rows = sorted(rows, key=lambda r: (r["tiled"], r["sp"], r["impl"] != "ours"))
    base = {(r["impl"], r["tiled"]): r for r in rows if r["sp"] == 1 and "error" not in r}
    print(f"\n### (a) longest global sequence within {args.budget_mib:g} MiB counted activations per rank\n")
    print("| impl | SP | TiledMLP + tiled loss | max seq (global) | tokens/rank | counted act. at max, MiB/rank "
          "| peak RSS at max, MiB (max rank) | vs SP=1 | vs DeepSpeed |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    ds = {(r["sp"], r["tiled"]): r for r in rows if r["impl"] == "deepspeed" and r.get("max_seq")}
    for r in rows:
        tag = "yes" if r["tiled"] else "no"
        if "error" in r:
            print(f"| {r['impl']} | {r['sp']} | {tag} | failed: {r['error'][:200]} | | | | | |")
            continue
        b = base.get((r["impl"], r["tiled"]))
        vs = f"{r['max_seq'] / b['max_seq']:.2f}x" if b and b.get("max_seq") else ""
        cap = "≥" if r["capped"] else ""
        d = ds.get((r["sp"], r["tiled"]))
        vs_ds = f"{r['max_seq'] / d['max_seq']:.2f}x" if d and r["impl"] != "deepspeed" else ""
        print(f"| {r['impl']} | {r['sp']} | {tag} | {cap}{r['max_seq']} | {r['max_seq'] // r['sp']} "
              f"| {r.get('act_at_max', 0) / MIB:.1f} | {r.get('rss_at_max', 0) / MIB:.0f} | {vs} | {vs_ds} |")
    print(f"\n### (b) step at {args.time_seq} global tokens (median of {args.steps}; wall = slowest rank, "
          "CPU = summed over ranks)\n")
    print("| impl | SP | TiledMLP + tiled loss | counted act., MiB/rank | x of SP=1 | wall s/step | vs SP=1 "
          "| CPU s/step | vs SP=1 | loss |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            continue
        b = base.get((r["impl"], r["tiled"]))
        tag = "yes" if r["tiled"] else "no"
        ratio = lambda k: f"{r[k] / b[k]:.2f}" if b else ""  # noqa: E731
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else ""
        print(f"| {r['impl']} | {r['sp']} | {tag} | {r['act_at_T'] / MIB:.1f} | {ratio('act_at_T')} "
              f"| {r['wall']:.2f} | {ratio('wall')} | {r['cpu']:.2f} | {ratio('cpu')} | {loss} |")
    print()
    for r in rows:
        if "search" in r:
            print(f"search {r['impl']} sp={r['sp']} tiled={r['tiled']}: " +
                  " ".join(f"{s}:{m}{'' if t else '(over)'}" for s, m, t in r["search"]))
        elif "error" in r:
            print(f"error {r['impl']} sp={r['sp']} tiled={r['tiled']}: {r['error']}")


def driver(args) -> int:
    if args.from_json:
        rows = []
        for path in args.from_json.split(","):
            with open(path) as f:
                rows += json.load(f)["rows"]
        print_tables(rows, args)
        return 0
    # Large blocks go straight to mmap and back to the OS when freed, so RSS follows the live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    rows, raw = [], []
    for impl in args.impls.split(","):
        for tiled in (int(t) for t in args.tiled.split(",")):
            for sp in (int(s) for s in args.sp.split(",")):
                t0 = time.time()
                job = launch(args, impl, sp, tiled)
                raw.append(dict(impl=impl, sp=sp, tiled=tiled, job=job))
                row = summarize(impl, sp, tiled, job, args.budget_mib * MIB)
                rows.append(row)
                print(f"[{impl} sp={sp} tiled={tiled}] {time.time() - t0:.0f}s "
                      f"{row.get('error') or 'max_seq=%s' % row.get('max_seq')}", flush=True)
    print_tables(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, raw=raw), f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
