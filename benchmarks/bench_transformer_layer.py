"""Forward+backward time of a stack of BERT encoder layers: DeepSpeedTransformerLayer (ours) vs
Hugging Face ``BertLayer`` (eager and SDPA attention) vs ``torch.nn.TransformerEncoderLayer``.

Run: ``.venv/bin/python benchmarks/bench_transformer_layer.py [--dtypes fp32,bf16] [--batch 2]
[--seq 128] [--layers 12] [--dropout 0.1] [--rounds 10]``.

All stacks get the same weights (copied from the HF layers), the same input and the same
additive padding mask (HF's [B,1,1,S] convention; a boolean key-padding mask for torch's layer),
and run Post-LN (BERT) with exact GELU. Pure-dtype runs: the stack is cast to bf16, no autocast.
Variants run round-robin (one step each per round, rotating order), so a load drift of the shared
machine hits all of them alike. The table gives each variant's best step and its ratio to the
fastest baseline's best (other load only ever adds time, so on a shared machine the best of N is the
steadiest estimate), the same for the median, and the median of the per-round ratios against the
baseline with the best step (< 1: ours is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import deepspeed


def hf_stack(args, attn: str) -> nn.ModuleList:
    from transformers.models.bert.modeling_bert import BertConfig, BertLayer

    cfg = BertConfig(hidden_size=args.hidden, num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                     hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return nn.ModuleList(BertLayer(cfg) for _ in range(args.layers))


def hf_tensors(layer):
    """The 8 weights and 8 biases of a BertLayer in DeepSpeed's initial_weights order."""
    sa, ao, out = layer.attention.self, layer.attention.output, layer.output
    mods = (sa.query, sa.key, sa.value, ao.dense, ao.LayerNorm, layer.intermediate.dense, out.dense, out.LayerNorm)
    return [m.weight for m in mods], [m.bias for m in mods]


def ds_stack(args, ref: nn.ModuleList) -> nn.ModuleList:
    cfg = lambda: deepspeed.DeepSpeedTransformerConfig(
        batch_size=args.batch, hidden_size=args.hidden, heads=args.heads, attn_dropout_ratio=args.dropout,
        hidden_dropout_ratio=args.dropout, num_hidden_layers=args.layers, initializer_range=0.02,
        pre_layer_norm=False, max_seq_length=args.seq)
    return nn.ModuleList(deepspeed.DeepSpeedTransformerLayer(cfg(), *hf_tensors(layer)) for layer in ref)


def torch_stack(args, ref: nn.ModuleList) -> nn.ModuleList:
    layers = nn.ModuleList()
    for src in ref:
        layer = nn.TransformerEncoderLayer(args.hidden, args.heads, 4 * args.hidden, args.dropout, activation="gelu",
                                           layer_norm_eps=1e-12, batch_first=True, norm_first=False)
        (w, b) = hf_tensors(src)
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(torch.cat(w[:3]))
            layer.self_attn.in_proj_bias.copy_(torch.cat(b[:3]))
            for dst, i in ((layer.self_attn.out_proj, 3), (layer.norm1, 4), (layer.linear1, 5), (layer.linear2, 6),
                           (layer.norm2, 7)):
                dst.weight.copy_(w[i])
                dst.bias.copy_(b[i])
        layers.append(layer)
    return layers


def make_step(kind: str, stack: nn.ModuleList, x: torch.Tensor, add_mask: torch.Tensor, pad: torch.Tensor):
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)

    def step():
        h = x
        for layer in stack:
            if kind == "torch":
                h = layer(h, src_key_padding_mask=pad)
            else:
                h = layer(h, add_mask)
        h.backward(grad)   # unit-scale gradients: a mean() loss drives deep-stack grads into denormals
    return step


def timed(step, stack: nn.ModuleList, x: torch.Tensor) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step; CPU time is less disturbed by other load."""
    stack.zero_grad(set_to_none=True)
    x.grad = None
    start, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - start, time.process_time() - cpu


def run_dtype(args, dtype: torch.dtype) -> dict[str, list[tuple[float, float]]]:
    """Per-variant step times over ``args.rounds`` rounds; each round runs every variant once, in
    a rotating order, so a drift in machine load hits all variants alike (paired samples)."""
    ref_eager = hf_stack(args, "eager")
    variants = {"ours": ds_stack(args, ref_eager), "hf-eager": ref_eager,
                "hf-sdpa": hf_stack(args, "sdpa"), "torch": torch_stack(args, ref_eager)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dtype).requires_grad_(True)
    pad = torch.zeros(args.batch, args.seq, dtype=torch.bool)
    pad[0, args.seq * 3 // 4:] = True                                  # first sequence padded to 3/4
    add_mask = torch.zeros(args.batch, 1, 1, args.seq, dtype=dtype).masked_fill(pad[:, None, None, :],
                                                                                 torch.finfo(dtype).min)
    steps = {}
    for name, stack in variants.items():
        stack.to(dtype).train()
        steps[name] = make_step("torch" if name == "torch" else "layer", stack, x, add_mask, pad)
        for _ in range(args.warmup):
            timed(steps[name], stack, x)
    names = list(variants)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(steps[name], variants[name], x))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, batch {args.batch}, seq {args.seq}, dropout {args.dropout}; forward+backward\n")
    print("| dtype | variant | best step (s) | best vs fastest baseline | median step (s) | median vs fastest "
          "baseline | paired (median of per-round ratios) | median CPU s / step |")
    print("|---|---|---|---|---|---|---|---|")
    for dname in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dname]
        times = run_dtype(args, dtype)
        wall = {name: [w for w, _ in t] for name, t in times.items()}
        cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
        best = {name: min(t) for name, t in wall.items()}
        medians = {name: statistics.median(t) for name, t in wall.items()}
        fastest = min((k for k in best if k != "ours"), key=best.get)
        fastest_median = min(v for k, v in medians.items() if k != "ours")
        for name, t in wall.items():
            paired = statistics.median(a / b for a, b in zip(t, wall[fastest]))
            cells = [f"{best[name] / best[fastest]:.3f}x", f"{medians[name] / fastest_median:.3f}x", f"{paired:.3f}x"]
            if name == "ours":
                cells = [f"**{c}**" for c in cells]
                cells[0] += f" (vs {fastest})"
            print(f"| {dname} | {name} | {best[name]:.3f} | {cells[0]} | {medians[name]:.3f} | {cells[1]} | "
                  f"{cells[2]} | {cpu[name]:.3f} |", flush=True)

if __name__ == "__main__":
    main()
