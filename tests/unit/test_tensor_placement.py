"""Tensors are placed on purpose ([Note: collective device] in deepspeed/comm/placement.py).

On a CPU machine every tensor is a host tensor, so a tensor created without a device works under
gloo and fails only on CUDA + NCCL: a collective over a host tensor raises ("No backend type
associated with device type cpu"), and stacking a host zero with device gradients raises too.
CPU tests cannot see that, so this test reads the package instead: every tensor factory call
(`torch.zeros`, `torch.tensor`, ...; the `*_like` and `Tensor.new_*` forms inherit their device
and are fine) names its `device=` (or passes `**kwargs` that may), and every literal CPU device
(`torch.device("cpu")`, `device="cpu"`) is deliberate. Where the host is meant (a checkpoint
file's tensors, an optimizer `step` counter, scalar arithmetic read back as a Python number), the
line says so and why with a `# host: <why>` comment. A marker on a line that needs none is an
error too, so markers do not outlive their code."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import deepspeed

PACKAGE = Path(deepspeed.__file__).parent
FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "range", "linspace",
                       "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
                       "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                       "IntTensor", "BoolTensor", "ByteTensor"})
MARKER = re.compile(r"#\s*host:(.*)$")
CANDIDATE = re.compile(r"torch\.(%s)\(|device\s*=|#\s*host:" % "|".join(sorted(FACTORIES | {"device"})))


def _is_torch_attr(node: ast.AST, names: frozenset[str] | set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def _cpu_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cpu"


def _needs_marker(call: ast.Call) -> str | None:
    """Why `call` must say it means the host, or None."""
    if _is_torch_attr(call.func, FACTORIES):
        if not any(k.arg in ("device", None) for k in call.keywords):   # None: **kwargs may carry it
            return f"torch.{call.func.attr}(...) without device="
    if _is_torch_attr(call.func, {"device"}) and call.args and _cpu_literal(call.args[0]):
        return "a literal CPU device"
    if any(k.arg == "device" and _cpu_literal(k.value) for k in call.keywords):
        return "a literal CPU device"
    return None


def violations(source: str, name: str = "<source>") -> list[str]:
    """Unmarked host placements and markers that mark nothing in one module's `source`."""
    if not CANDIDATE.search(source):   # most modules: no need to parse
        return []
    lines = source.splitlines()
    marked = {i + 1: m.group(1).strip() for i, line in enumerate(lines) if (m := MARKER.search(line))}
    used: set[int] = set()
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call) or (why := _needs_marker(node)) is None:
            continue
        span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        reasons = [line for line in span if line in marked]
        used.update(reasons)
        if not reasons:
            found.append(f"{name}:{node.lineno}: {why}: {lines[node.lineno - 1].strip()}")
        elif not any(marked[line] for line in reasons):
            found.append(f"{name}:{node.lineno}: '# host:' without a reason")
    found += [f"{name}:{line}: '# host:' marks no host placement" for line in sorted(set(marked) - used)]
    return found


def test_every_tensor_of_the_package_is_placed_on_purpose() -> None:
    start = time.perf_counter()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert not found, ("tensors placed on the host by default (they break on CUDA + NCCL); pass device= "
                       "(ds_comm.collective_device(group) for a collective's own tensors, the data's device "
                       "for what joins device data), or add '# host: <why>' where the host is meant:\n  "
                       + "\n  ".join(found))
    assert time.perf_counter() - start < 10.0   # ~0.5 s on an idle core


def test_the_check_catches_the_shapes_it_is_for() -> None:
    # issue 37's two cases as they were: a host int64 all-reduced under NCCL, a host zero stacked
    # with device gradients
    agree = ("def _agree(values, group):\n"
             "    t = torch.tensor(values, dtype=torch.int64)\n"
             "    ds_comm.all_reduce(t, op=ds_comm.ReduceOp.MAX, group=group)\n")
    stack = "stacked = torch.stack([g if g is not None else torch.zeros(()) for g in grads])\n"
    fallback = "comm_device = buckets[0].device if buckets else torch.device('cpu')\n"
    for source in (agree, stack, fallback, "x = torch.empty(3, device='cpu')\n"):
        assert len(violations(source)) == 1, source
    fixed = ("t = torch.tensor(values, dtype=torch.int64, device=ds_comm.collective_device(group))\n"
             "z = torch.zeros(shape, **kw)\n"
             "s = {'step': torch.tensor(0.0)}  # host: torch.optim keeps step counters on the host\n"
             "y = torch.zeros_like(x)\n")
    assert violations(fixed) == []
    assert violations("n = 1  # host: stale\n") == ["<source>:1: '# host:' marks no host placement"]
    assert violations("t = torch.zeros(1)  # host:\n") == ["<source>:1: '# host:' without a reason"]
    multi = "t = torch.zeros(\n    3,  # host: a host buffer\n    dtype=torch.int8)\n"
    assert violations(multi) == []


def test_collective_device_is_the_host_for_gloo_and_without_a_group() -> None:
    import torch

    import deepspeed.comm as ds_comm

    assert ds_comm.collective_device() == torch.device("cpu")   # no process group in tests/unit
