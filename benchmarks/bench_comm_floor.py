"""Communication of composed layouts against each dimension's floor (issue 38 item 6), 4 or 8 ranks on CPU.

    python benchmarks/bench_comm_floor.py [--layouts dp2tp2-z1,...] [--impls ours,ds] [--ds-venv /tmp/ds-venv]

A tiny Hugging Face Llama (built from a config, fp32, SGD) trains a few steps in each layout; one step
after warm-up is counted per rank, every collective with its group's global ranks:

* ours: `deepspeed.comm.comms_counter` with `keep_records` (the group's ranks on each record);
* DeepSpeed 0.19.8: its `deepspeed.comm.torch.TorchBackend` methods wrapped (every collective of its
  runtime goes through that backend object), outermost call only.

Each record goes to the mesh dimension whose group it ran on (ranks laid out data x sequence x tensor,
tensor fastest, as both implementations order them) and is counted in ring wire bytes, what one rank
sends with a bandwidth-optimal algorithm: 2(N-1)/N of the message for all-reduce, (N-1)/N for
reduce-scatter, all-gather and all-to-all. Collectives of at most 16 elements (norms, token counts, the
loss join, position ids) are listed apart as bookkeeping. The floors, per rank per step, fp32:

* data (ZeRO over data x sequence, N ranks, Psi = parameters this rank holds after TP slicing):
  ZeRO-1/2 reduce-scatter gradients + all-gather parameters = 2 Psi (N-1)/N; ZeRO-3 all-gathers each
  parameter for the forward and reduce-scatters its gradient, also 2 Psi (N-1)/N when the gathered
  parameter lives until its backward; the textbook 3 Psi (N-1)/N re-gathers it there, which shows as
  excess (every parameter partitioned here: stage3_param_persistence_threshold 0);
* tensor (T ranks, t tokens on this rank): the row layers' outputs all-reduced in the forward (o_proj,
  down_proj) and the block inputs' gradients in the backward (attention and MLP) = 4 L t H 2(T-1)/T;
  with a vocab-sliced LM head also its logits gathered, t V (T-1)/T, and its input's gradient
  all-reduced, t H 2(T-1)/T;
* sequence (P ranks): Ulysses' all-to-alls of q, k, v and the attention output, forward and backward =
  2 L t d (2 h + 2 k) (P-1)/P with h, k this rank's query / key-value heads (after TP) and d the head size,
  plus the position ids gathered once per forward (int64).

pp2tp2-z1 is examples/megatron_3d's model (its own Megatron-style tensor layers) in 2 pipeline stages x 2
tensor slices, 4 micro-batches of 4 per step: its floors are, per micro-batch, 2 all-reduces of the
activations per block on this stage (forward g, backward f) and one activation or gradient sent to the
next / previous stage. Layouts that a build refuses or fails show as an error row.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _ds_child import add_impl_args, chosen_impls, run_case_and_report, run_child  # noqa: E402
from _ranks import rank_environment  # noqa: E402

LAYOUTS = {   # name: (dp, sp, tp, ZeRO stage); dp x sp x tp ranks, tensor fastest
    "dp2tp2-z1": (2, 1, 2, 1),
    "dp2tp2-z2": (2, 1, 2, 2),
    "dp2tp2-z3": (2, 1, 2, 3),
    "dp2sp2-z1": (2, 2, 1, 1),
    "sp2tp2-z1": (1, 2, 2, 1),
    "pp2tp2-z1": (2, 1, 2, 1),   # pipeline 2 (in the data slot) x tensor 2: examples/megatron_3d
    "dp2sp2tp2-z1": (2, 2, 2, 1),   # 8 ranks
}
PIPE = {"micro": 4, "gas": 4}   # the 3-D example's defaults
BOOKKEEPING = 16   # elements: a collective this small is bookkeeping, not a dimension's payload
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "inference_all_reduce": lambda n: 2 * (n - 1) / n}


def wire(op: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if op in ("recv", "irecv"):   # counted where it is sent
        return 0.0
    if op in ("send", "isend", "broadcast"):
        return nbytes
    return nbytes * RING.get(op, lambda m: (m - 1) / m)(n)


def dim_groups(dp: int, sp: int, tp: int, pipe: bool = False) -> dict[tuple[int, ...], str]:
    """Every group of the layout by its sorted global ranks -> the dimensions it is, joined by " = " when
    one set of ranks serves several (sp 2 x tp 2: the ZeRO group data x sequence is the sequence group).
    `pipe`: the slowest axis is the pipeline (PipeModelDataParallelTopology, data 1), not data."""
    coords = {r: (r // (sp * tp), (r // tp) % sp, r % tp) for r in range(dp * sp * tp)}
    spans = {"tensor": (2,), "sequence": (1,), "data": (0,), "data x sequence": (0, 1), "world": (0, 1, 2)}
    if sp == 1:   # ZeRO's group is the data group
        del spans["data x sequence"]
    if pipe:
        spans = {"tensor": (2,), "pipeline": (0,), "world": (0, 1, 2)}
    names: dict[tuple[int, ...], list[str]] = {}
    for name, free in spans.items():
        for r in coords:
            ranks = tuple(q for q in coords if all(coords[q][a] == coords[r][a] for a in range(3) if a not in free))
            if len(ranks) > 1 and name not in names.setdefault(ranks, []):
                names[ranks].append(name)
    return {ranks: " = ".join(n for n in dims if n != "world" or len(dims) == 1) for ranks, dims in names.items()}


# --- counting in the child ----------------------------------------------------------------------
_RECORDS: list[tuple[str, int, int, tuple[int, ...]]] = []   # (op, numel, bytes, ranks) for DeepSpeed 0.19.8
_COUNTING = {"on": False, "depth": 0}


def _wrap_upstream_backend() -> None:
    """Wrap DeepSpeed 0.19.8's TorchBackend collectives: record the outermost call with its group."""
    import torch
    import torch.distributed as tdist
    from deepspeed.comm.torch import TorchBackend

    def message(name, args, kwargs):
        values = list(args) + list(kwargs.values())
        lists = [list(v) for v in values if isinstance(v, (list, tuple)) and v and torch.is_tensor(v[0])]
        tensors = [v for v in values if torch.is_tensor(v)]
        if lists:
            return sum(t.numel() for t in lists[0]), sum(t.numel() * t.element_size() for t in lists[0])
        if "gather" in name and len(tensors) >= 2:      # (output, input): the output is the message
            t = tensors[0]
        elif len(tensors) >= 2 and ("scatter" in name or "all_to_all" in name):
            t = tensors[1]                               # (output, input): the input is the message
        else:
            t = tensors[0]
        return t.numel(), t.numel() * t.element_size()

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            outer = _COUNTING["on"] and _COUNTING["depth"] == 0
            _COUNTING["depth"] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                _COUNTING["depth"] -= 1
                if outer:   # the group: by keyword, or positional (its backend passes it either way)
                    group = kwargs.get("group", next((a for a in args if isinstance(a, tdist.ProcessGroup)), None))
                    ranks = tuple(tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD))
                    numel, nbytes = message(name, args, kwargs)
                    _RECORDS.append((name, numel, nbytes, ranks))
        return counted

    for name in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                 "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
                 "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
                 "gather", "scatter"):
        if hasattr(TorchBackend, name):
            setattr(TorchBackend, name, wrap(name, getattr(TorchBackend, name)))


def _start_counting(ours: bool) -> None:
    import deepspeed.comm as dist

    if ours:
        dist.comms_counter.keep_records = True
        dist.comms_counter.reset()
    _RECORDS.clear()
    _COUNTING["on"] = True


def _stop_counting(ours: bool) -> list:
    import deepspeed.comm as dist

    _COUNTING["on"] = False
    if ours:
        rows = [(r.op, r.numel, r.nbytes, tuple(r.ranks or ())) for r in dist.comms_counter.records]
        dist.comms_counter.keep_records = False
        return [r for r in rows if r[0] != "barrier"]
    return list(_RECORDS)


class _JoinLoss:
    """The shard losses joined by token count (what transformers' SP loss does), differentiable, with
    deepspeed.comm only: forward all-gather, backward all-reduce of the (scalar) gradients."""

    @staticmethod
    def apply(value, group):
        import torch

        import deepspeed.comm as dist

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, x.contiguous(), group=group)
                return torch.stack(parts)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                dist.all_reduce(grad, group=group)
                return grad[dist.get_rank(group)]

        return Gather.apply(value)


def _pipeline(row: dict, pp: int, tp: int, stage: int, cfg: dict, ours: bool) -> None:
    """examples/megatron_3d/train.py's model (its own Megatron-style tensor layers in a PipelineModule over
    PipeModelDataParallelTopology(pp, tp, 1)), one train_batch of its micro-batches counted."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "megatron_3d"))
    import train as m3d
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import deepspeed

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    tp_rank = topology.get_coord(int(os.environ["RANK"])).model
    holder: dict = {}
    layers = ([LayerSpec(m3d.Embedding)] + [LayerSpec(m3d.ParallelBlock, i, tp, tp_rank,
                                                      lambda: holder["module"].mpu().get_slice_parallel_group())
                                            for i in range(m3d.BLOCKS)] + [LayerSpec(m3d.Head)])
    model = holder["module"] = PipelineModule(layers, topology=topology, loss_fn=m3d.lm_loss,
                                              partition_method="uniform")
    micro, gas = PIPE["micro"], PIPE["gas"]
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    row["numel_local"] = sum(p.numel() for p in engine.module.parameters())
    row["lm_head_sharded"] = False
    row["losses"], row["records"] = [], []
    import deepspeed.comm as dist

    for step in range(cfg["warmup"] + 1):
        ids, labels = m3d.global_batch(step, micro * gas)
        batches = [(ids[s:s + micro], labels[s:s + micro]) for s in range(0, micro * gas, micro)]
        dist.barrier()
        if step == cfg["warmup"]:
            _start_counting(ours)
        row["losses"].append(float(engine.train_batch(iter(batches))))
        if step == cfg["warmup"]:
            row["records"] = _stop_counting(ours)


def _model(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=2 * cfg["hidden"],
                         num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"],
                         num_hidden_layers=cfg["layers"], vocab_size=cfg["vocab"], max_position_embeddings=cfg["seq"],
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _rank(rank: int, world: int, port: int, layout: str, cfg: dict, out: str, queue) -> None:
    rank_environment(rank, world, port)
    if cfg.get("ext_dir"):   # DeepSpeed's JIT-built shm op: built once for every case, not once per case
        os.environ["TORCH_EXTENSIONS_DIR"] = cfg["ext_dir"]
    if cfg.get("hf_site"):   # transformers where the DeepSpeed venv has none: the model code only, after
        sys.path.append(cfg["hf_site"])   # the venv's own packages (its torch and deepspeed come first)
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    ours = "pure" in deepspeed.__version__
    if not ours:
        _wrap_upstream_backend()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    dp, sp, tp, stage = LAYOUTS[layout]
    micro, seq = cfg["micro"], cfg["seq"]
    row: dict = {"rank": rank}
    try:
        if layout.startswith("pp"):
            _pipeline(row, dp, tp, stage, cfg, ours)
            raise StopIteration
        model = _model(cfg)
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        if stage == 3:   # every parameter partitioned (none kept whole for being small), as at scale
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if tp > 1:
            config["tensor_parallel"] = {"autotp_size": tp}
        mpu = None
        if sp > 1:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
                micro_batch_size=micro, seq_length=seq, seq_length_is_variable=False)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
        from deepspeed.utils import groups

        sp_group = groups._get_sequence_parallel_group() if sp > 1 else None
        sp_rank = dist.get_rank(sp_group) if sp > 1 else 0
        d = rank // (sp * tp)
        local = seq // sp
        g = torch.Generator().manual_seed(0)
        sizes = {n: (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for n, p in engine.module.named_parameters()}
        row["numel_local"] = sum(sizes.values())
        row["lm_head_sharded"] = sizes["lm_head.weight"] < cfg["vocab"] * cfg["hidden"]
        row["losses"], row["records"] = [], []
        for step in range(cfg["warmup"] + 1):
            ids = torch.randint(0, cfg["vocab"], (dp * micro, seq), generator=g)[d * micro:(d + 1) * micro]
            shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            cut = slice(sp_rank * local, (sp_rank + 1) * local)
            pos = torch.arange(seq).expand(micro, seq)
            counted = step == cfg["warmup"]
            dist.barrier()
            if counted:
                _start_counting(ours)
            logits = engine(input_ids=ids[:, cut], position_ids=pos[:, cut]).logits
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                   shift[:, cut].reshape(-1), reduction="mean")
            if sp > 1:   # equal shard lengths and every target valid: the mean of the shard means
                loss = _JoinLoss.apply(ce, sp_group).mean()
            else:
                loss = ce
            engine.backward(loss)
            engine.step()
            if counted:
                row["records"] = _stop_counting(ours)
            row["losses"].append(float(loss.detach()))
    except StopIteration:
        pass
    except Exception as exc:   # a refused or failing layout is a row, not the end of the run
        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    try:
        dist.barrier()
    except Exception:
        pass
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"):   # DeepSpeed's CPU comm leaves these
        os.unlink(path)
    if rank == 0:
        queue.put("done")


# --- floors and the report ----------------------------------------------------------------------
def floors(layout: str, cfg: dict, numel_local: int, lm_head_sharded: bool) -> dict[str, float]:
    """Each dimension's floor in wire bytes per rank per step (fp32), as the module docstring derives."""
    dp, sp, tp, stage = LAYOUTS[layout]
    if layout.startswith("pp"):   # the 3-D example: per micro-batch, per block on this stage 2 all-reduces
        from importlib import util   # of its activations; one activation (or its gradient) sent per micro-batch

        spec = util.spec_from_file_location("m3d", os.path.join(os.path.dirname(HERE), "examples", "megatron_3d",
                                                               "train.py"))
        m3d = util.module_from_spec(spec)
        spec.loader.exec_module(m3d)
        act = PIPE["micro"] * m3d.SEQ * m3d.HIDDEN * 4
        return {"tensor": PIPE["gas"] * (m3d.BLOCKS // dp) * 2 * act * 2 * (tp - 1) / tp,
                "pipeline": PIPE["gas"] * act}
    H, L, nh, V = cfg["hidden"], cfg["layers"], cfg["heads"], cfg["vocab"]
    t = cfg["micro"] * cfg["seq"] // sp           # tokens on this rank
    out: dict[str, float] = {}
    zero = dp * sp
    if zero > 1:   # ZeRO-3 too: each parameter gathered once, kept until its backward (a re-gather is excess)
        out["data x sequence" if sp > 1 else "data"] = 2 * numel_local * 4 * (zero - 1) / zero
    if tp > 1:
        ring = (tp - 1) / tp
        out["tensor"] = 4 * L * t * H * 4 * 2 * ring
        if lm_head_sharded:   # a vocab-sliced head: its logits gathered, its input's gradient all-reduced
            out["tensor"] += t * V * 4 * ring + t * H * 4 * 2 * ring
    if sp > 1:
        h = k = nh // tp
        # the all-to-alls, and the sequence's position ids gathered once per forward (int64)
        out["sequence"] = (2 * L * t * (H // nh) * (2 * h + 2 * k) * 4 + t * sp * 8) * (sp - 1) / sp
    return out


def tally(layout: str, records: list) -> dict[tuple[str, str], list[float]]:
    """{(dimension, op): [calls, wire bytes]}; bookkeeping collectives under ("bookkeeping", op)."""
    dp, sp, tp, _ = LAYOUTS[layout]
    names = dim_groups(dp, sp, tp, layout.startswith("pp"))
    out: dict[tuple[str, str], list[float]] = {}
    for op, numel, nbytes, ranks in records:
        n = len(ranks)
        if n <= 1:
            continue
        if op in ("send", "recv", "isend", "irecv") and layout.startswith("pp"):
            dim = "pipeline"   # point-to-point: ours records no group (the world), only its peer
        else:
            dim = "bookkeeping" if numel <= BOOKKEEPING else names.get(tuple(sorted(ranks)), f"ranks {list(ranks)}")
        cell = out.setdefault((dim, op), [0, 0.0])
        cell[0] += 1
        cell[1] += wire(op, nbytes, n)
    return out


def child(args) -> None:
    cfg = json.loads(args.child_cfg)
    dp, sp, tp, _ = LAYOUTS[args.child_layout]
    run_case_and_report(_rank, dp * sp * tp, args.child_layout, cfg, timeout=args.job_timeout)


def kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def report(layout: str, impl: str, result: dict, cfg: dict, verbose: bool = False) -> list[str]:
    name = "ours" if impl == "ours" else f"DeepSpeed {result.get('version', '0.19.8')}"
    if "ranks" not in result:
        return [f"| {layout} | {name} | error: {result.get('error', '')[:300]} ||||"]
    errors = [r["error"] for r in result["ranks"] if "error" in r]
    if errors:
        return [f"| {layout} | {name} | error: {errors[0][:300]} ||||"]
    r0 = result["ranks"][0]
    got = tally(layout, r0["records"])
    floor: dict[str, float] = {}
    groups = dim_groups(*LAYOUTS[layout][:3], layout.startswith("pp"))
    for dims, value in floors(layout, cfg, r0["numel_local"], r0["lm_head_sharded"]).items():
        # under the name its group carries (sp 2 x tp 2: "sequence = data x sequence")
        joined = next((n for n in groups.values() if dims in n.split(" = ")), dims)
        floor[joined] = floor.get(joined, 0.0) + value
    if verbose:
        for op, numel, nbytes, ranks in r0["records"]:
            print(f"    {op} {numel} elements on {list(ranks)}", flush=True)
    lines = []
    for dim in sorted({d for d, _ in got} | set(floor)):
        ops = {op: v for (d, op), v in got.items() if d == dim}
        measured = sum(v[1] for v in ops.values())
        detail = ", ".join(f"{op} x{int(v[0])} {kib(v[1])}" for op, v in sorted(ops.items()))
        want = floor.get(dim)
        ratio = f"{measured / want:.3f}" if want else "-"
        lines.append(f"| {layout} | {name} | {dim} | {kib(measured)} | {kib(want) if want else '-'} | {ratio} "
                     f"| {detail} |")
    total = sum(v[1] for v in got.values())
    lines.append(f"| {layout} | {name} | **all** | **{kib(total)}** | **{kib(sum(floor.values()))}** | "
                 f"**{total / sum(floor.values()):.3f}** | Psi/rank {r0['numel_local']}, losses "
                 f"{', '.join(f'{x:.4f}' for x in r0['losses'])} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--records", action="store_true", help="print rank 0's counted collectives one by one")
    p.add_argument("--save", help="append each case's raw result (JSON lines) here; --load reports them again")
    p.add_argument("--load", help="report the results saved by --save instead of running")
    add_impl_args(p)
    p.add_argument("--child-layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--child-cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_layout:
        child(args)
        return 0
    cfg = dict(hidden=args.hidden, heads=args.heads, layers=args.layers, vocab=args.vocab, seq=args.seq,
               micro=args.micro, warmup=args.warmup,
               ext_dir=os.path.join(tempfile.gettempdir(), "bench_comm_floor_torch_extensions"),
               hf_site=sysconfig.get_paths()["purelib"])
    impls = chosen_impls(args)
    print(f"tiny Llama: hidden {args.hidden}, {args.heads} heads (= key/value heads), {args.layers} layers, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch {args.micro}; fp32 SGD; dp x sp x tp ranks x 1 thread, gloo; "
          f"step "
          f"{args.warmup + 1} counted on rank 0; KiB of ring wire bytes per rank")
    print("| layout | impl | dimension | measured KiB | floor KiB | measured / floor | collectives (calls, KiB) |")
    print("|---|---|---|---|---|---|---|")
    if args.load:
        with open(args.load) as f:
            for line in f:
                saved = json.loads(line)
                for row in report(saved["layout"], saved["impl"], saved["result"], saved["cfg"], args.records):
                    print(row, flush=True)
        return 0
    for layout in args.layouts.split(","):
        for impl in impls:
            argv = ["--child-layout", layout, "--child-cfg", json.dumps(cfg), "--job-timeout", str(args.job_timeout)]
            result = run_child(impl, __file__, argv, args.ds_venv, args.job_timeout)
            if args.save:
                with open(args.save, "a") as f:
                    f.write(json.dumps({"layout": layout, "impl": impl, "cfg": cfg, "result": result}) + "\n")
            for line in report(layout, impl, result, cfg, args.records):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
