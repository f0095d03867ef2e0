"""The Muon math on one whole matrix: momentum, Newton-Schulz orthogonalisation, shape scaling.

[Note: Muon semantics]
We follow DeepSpeed's (0.18.9+) Muon, which follows Keller Jordan's reference: per step
`m <- lerp(m, g, 1-beta)`, Nesterov direction `u = lerp(g, m, beta)`, `O = NS(u)` with five
quintic iterations (a, b, c) = (3.4445, -4.7750, 2.0315) on `X / (||X||_F + 1e-7)` (transposed
when it has more rows than columns), `O *= sqrt(max(1, rows/cols))`, then
`p <- p * (1 - lr*wd) - lr * O`. `ns_method` picks the iteration: "gram" (upstream's default:
iterate on the Gram matrix X X^T, restarted at iteration 2; the same as "standard" for square
matrices) or "standard". The compute dtype is upstream's: bf16 for "standard" where the
accelerator has bf16, fp16 for "gram" where it has fp16 (on CPU: where oneDNN has fp16
kernels), fp32 otherwise. Conv weights are viewed as (out, in*k*k).

torch.optim.Muon differs in three roundings, not in the method: it normalises by
`max(||X||, eps)` instead of `||X|| + eps`, fuses `b*A + c*A@A` and `a*X + B@X` into addmm, and
applies the shape scale to the learning rate (fp32) instead of to the bf16 update. Its only
method is "standard" in bf16. See docs/zero.md "Muon" for the measured distance.

The update's elementwise steps (momentum, Nesterov) give the same bits on any slice of a
tensor; only NS needs the whole matrix, which is why ZeRO gathers it (zero/muon/sharded.py).
"""

from __future__ import annotations

import torch

NS_METHODS = ("gram", "standard")
NS_ALIASES = {"newtonschulz5": "standard"}   # muon_update's callers may name the kernel
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
_GRAM_RESTART = 2


def ns_compute_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in for `ns_method` on `device` (upstream's rule)."""
    if device.type == "cpu":
        bf16 = True
        fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    else:
        from ....accelerator import get_accelerator

        bf16, fp16 = get_accelerator().is_bf16_supported(), get_accelerator().is_fp16_supported()
    if ns_method == "gram":
        return torch.float16 if fp16 else torch.float32
    return torch.bfloat16 if bf16 else torch.float32


def check_ns_method(value: object, where: str = "ns_method") -> str:
    if value not in NS_METHODS:
        raise ValueError(f"{where}: got {value!r}; accepted: {', '.join(map(repr, NS_METHODS))}")
    return str(value)


def _normalised(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), tall


def newton_schulz_standard(g: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS) -> torch.Tensor:
    """Quintic Newton-Schulz on X itself; returns the (approximately) orthogonal factor in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x, tall = _normalised(g, dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def newton_schulz_gram(g: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS) -> torch.Tensor:
    """The same polynomial iterated on the small Gram matrix R = X X^T, accumulating Q so that
    the result is Q X; restarted from X at iteration 2 to bound the error of half precision.
    Square matrices gain nothing and take the standard iteration."""
    a, b, c = NS_COEFFICIENTS
    x, tall = _normalised(g, dtype)
    if x.size(-1) <= x.size(-2):
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.mT if tall else x
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


def momentum_direction(grad: torch.Tensor, momentum: torch.Tensor, beta: float) -> torch.Tensor:
    """Update `momentum` in place and return the Nesterov direction (elementwise: any slice works)."""
    momentum.lerp_(grad, 1 - beta)
    return grad.lerp(momentum, beta)


def orthogonalize(direction: torch.Tensor, shape: torch.Size, ns_method: str, steps: int = NS_STEPS,
                  num_heads: int | None = None) -> torch.Tensor:
    """NS of the whole matrix `direction` (any layout of `shape`'s elements in order), scaled by
    sqrt(max(1, rows/cols)); returned flat in the NS compute dtype (what travels back under ZeRO).
    With `num_heads` (per-head Muon, `param.muon_num_heads`), the (rows, cols) matrix is the stack
    of `num_heads` row blocks and each block is orthogonalised (and scaled) on its own.

    The kernel is looked up by its upstream module attribute at call time: every Muon path (no
    ZeRO, ZeRO's owner rank, per-head) goes through it, so a wrapper set on
    `original_muon.zeropower_via_*` (profiling, counting, a fused kernel) sees every call."""
    matrix = direction.reshape(shape[0], -1)
    if num_heads is not None:
        matrix = split_heads(matrix, shape, num_heads)
    kernel = zeropower_via_gram_newtonschulz if ns_method == "gram" else zeropower_via_newtonschulz5
    update = kernel(matrix, steps)
    update *= max(1, matrix.size(-2) / matrix.size(-1)) ** 0.5
    return update.reshape(-1)


def split_heads(matrix: torch.Tensor, shape: torch.Size, num_heads: int) -> torch.Tensor:
    """(rows, cols) -> (num_heads, rows // num_heads, cols), or upstream's ValueError for a
    parameter that is not a 2-D projection with whole heads on its rows."""
    if len(shape) != 2:
        raise ValueError(f"Per-head Muon expects a 2D attention projection, got shape {tuple(shape)}.")
    rows, cols = matrix.shape
    if num_heads < 1 or rows % num_heads:
        raise ValueError(f"Per-head Muon needs the output dim to split evenly across heads, but {rows} is not "
                         f"divisible by num_heads={num_heads}.")
    return matrix.view(num_heads, rows // num_heads, cols)


def adam_direction(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                   betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Bias-corrected Adam direction (the auxiliary AdamW half of MuonWithAuxAdam)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    bias1 = 1 - betas[0] ** step
    bias2 = 1 - betas[1] ** step
    return (exp_avg / bias1) / ((exp_avg_sq / bias2).sqrt() + eps)


# --- upstream's module-level names (its tests and some clients call them) -----------------------
def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    return newton_schulz_standard(G, ns_compute_dtype("standard", G.device), steps)


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    return newton_schulz_gram(G, ns_compute_dtype("gram", G.device), steps)


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = NS_STEPS,
                nesterov: bool = True, ns_method: str = "gram", is_expert_group: bool = False,
                num_heads: int | None = None) -> torch.Tensor:
    """Upstream's one-matrix Muon update: advances `momentum` in place and returns the scaled,
    orthogonalised update as a (rows, rest) matrix in `grad`'s dtype (per head with `num_heads`).
    `ns_method` "newtonschulz5" is accepted as the kernel's name for "standard"."""
    if is_expert_group:
        raise NotImplementedError("muon_update(is_expert_group=True): per-expert Newton-Schulz needs expert "
                                  "parallelism, which this build does not implement")
    ns_method = check_ns_method(NS_ALIASES.get(ns_method, ns_method))
    direction = momentum_direction(grad, momentum, beta) if nesterov else momentum.lerp_(grad, 1 - beta)
    update = orthogonalize(direction, grad.shape, ns_method, ns_steps, num_heads)
    return update.reshape(grad.shape[0], -1).to(grad.dtype)
