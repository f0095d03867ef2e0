"""Text of the FLOPs profile: number formats and the three sections upstream prints (summary,
aggregated profile per depth, detailed module tree). Pure functions of a profile snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_PRECISION = 2
_SCALES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`num` with an SI prefix, e.g. 1.23 G (upstream's format: `{value:g} {prefix}`)."""
    if units is None:
        units, magnitude = next(((u, m) for u, m in _SCALES if num >= m or (m == 1.0 and num == 0)), ("u", 1e-6))
    else:
        magnitude = dict(_SCALES).get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(b, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(duration, units=units, precision=precision)}s"


@dataclass
class ModuleRow:
    """One module of a profile: inclusive forward FLOPs, parameters and latency (seconds)."""

    name: str
    type_name: str
    depth: int
    flops: int
    params: int
    duration: float
    extra_repr: str
    children: list["ModuleRow"] = field(default_factory=list)

    @property
    def macs(self) -> int:
        return self.flops // 2


@dataclass
class EngineTimes:
    """What the engine measured around a profiled step (seconds; None: not measured)."""

    world_size: int
    dp_world_size: int
    mp_world_size: int
    micro_batch: int
    fwd: float | None = None
    bwd: float | None = None
    step: float | None = None
    measured_bwd_flops: int | None = None


def _pct(part: float, whole: float) -> float:
    return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0


def summary_lines(root: ModuleRow, profile_step: int, times: EngineTimes | None, bwd_factor: float,
                  op_flops: dict[str, int]) -> list[str]:
    """Upstream's "Profile Summary" block (its line format), plus the FLOPs by operator."""
    fmt = "{:<70}  {:<8}"
    out = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
           f"Profile Summary at step {profile_step}:",
           "Notations:\ndata parallel size (dp_size), model parallel size(mp_size),\n"
           "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
           "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
           "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
           "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"]
    mp = times.mp_world_size if times else 1
    if times:
        out += [fmt.format("world size: ", times.world_size), fmt.format("data parallel size: ", times.dp_world_size),
                fmt.format("model parallel size: ", mp), fmt.format("batch size per GPU: ", times.micro_batch)]
    flops = root.flops
    out += [fmt.format("params per GPU: ", params_to_string(root.params)),
            fmt.format("params of model = params per GPU * mp_size: ", params_to_string(root.params * mp)),
            fmt.format("fwd MACs per GPU: ", macs_to_string(root.macs)),
            fmt.format("fwd flops per GPU: ", number_to_string(flops)),
            fmt.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp))]
    fwd = times.fwd if times and times.fwd else root.duration
    out.append(fmt.format("fwd latency: ", duration_to_string(fwd)))
    out.append(fmt.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
                          flops_to_string(flops / fwd if fwd else 0)))
    if times and times.measured_bwd_flops is not None:
        out.append(fmt.format("bwd flops per GPU (measured): ", number_to_string(times.measured_bwd_flops)))
    if times and times.bwd and times.step is not None:
        bwd_flops = times.measured_bwd_flops if times.measured_bwd_flops is not None else bwd_factor * flops
        label = "measured bwd flops" if times.measured_bwd_flops is not None else f"{bwd_factor:g} * fwd flops per GPU"
        iteration = fwd + times.bwd + times.step
        out += [fmt.format("bwd latency: ", duration_to_string(times.bwd)),
                fmt.format(f"bwd FLOPS per GPU = {label} / bwd latency: ", flops_to_string(bwd_flops / times.bwd)),
                fmt.format("fwd+bwd FLOPS per GPU = (fwd+bwd flops) / (fwd+bwd latency): ",
                           flops_to_string((flops + bwd_flops) / (fwd + times.bwd))),
                fmt.format("step latency: ", duration_to_string(times.step)),
                fmt.format("iter latency: ", duration_to_string(iteration)),
                fmt.format("FLOPS per GPU = (fwd+bwd flops) / iter latency: ",
                           flops_to_string((flops + bwd_flops) / iteration)),
                fmt.format("samples/second: ", round(times.micro_batch * times.dp_world_size / iteration,
                                                     DEFAULT_PRECISION))]
    total_ops = sum(op_flops.values())
    if total_ops:
        ranked = sorted(op_flops.items(), key=lambda kv: -kv[1])
        out.append(fmt.format("fwd flops by operator: ", ", ".join(f"{op} {_pct(v, total_ops):g}%" for op, v in ranked)))
    return out


def aggregated_lines(root: ModuleRow, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """Top `top_modules` module types by params, MACs and latency at each depth (upstream's block)."""
    per_depth: dict[int, dict[str, list[float]]] = {}

    def walk(row: ModuleRow) -> None:
        totals = per_depth.setdefault(row.depth, {}).setdefault(row.type_name, [0, 0, 0.0])
        totals[0] += row.macs
        totals[1] += row.params
        totals[2] += row.duration
        for child in row.children:
            walk(child)

    walk(root)
    depth = len(per_depth) - 1 if module_depth == -1 else module_depth
    out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(per_depth))):
        items = per_depth[d].items()

        def top(index: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(items, key=lambda kv: kv[1][index], reverse=True)[:top_modules]
            return {k: fmt(v[index]) for k, v in ranked}

        out += [f"depth {d}:", f"    params      - {top(1, params_to_string)}",
                f"    MACs        - {top(0, macs_to_string)}", f"    fwd latency - {top(2, duration_to_string)}"]
    return out


def _row_text(row: ModuleRow, total: ModuleRow) -> str:
    items = [f"{params_to_string(row.params)} = {_pct(row.params, total.params):g}% Params",
             f"{macs_to_string(row.macs)} = {_pct(row.macs, total.macs):g}% MACs",
             f"{duration_to_string(row.duration)} = {_pct(row.duration, total.duration):g}% latency",
             flops_to_string(round(row.flops / row.duration, DEFAULT_PRECISION) if row.duration else 0)]
    if row.extra_repr:
        items.append(row.extra_repr)
    return ", ".join(items)


def tree_lines(root: ModuleRow) -> list[str]:
    """The module tree as `print(model)` shows it, each module's profile before its own extra_repr."""

    def render(row: ModuleRow, total: ModuleRow) -> str:
        body = _row_text(row, total)
        if not row.children:
            return f"{row.type_name}({body})"
        lines = [f"{row.type_name}(", "  " + body]
        for child in row.children:
            child_text = render(child, total).replace("\n", "\n  ")
            lines.append(f"  ({child.name.rsplit('.', 1)[-1]}): {child_text}")
        return "\n".join(lines + [")"])

    return render(root, root).split("\n")


DETAILED_HEADER = [
    "", "------------------------------ Detailed Profile per GPU ------------------------------",
    "Each module profile is listed after its name in the following order: ",
    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency,"
    " fwd FLOPS",
    "",
    "Note: 1. FLOPs are counted by torch.utils.flop_counter: matrix multiplications, convolutions and attention "
    "(the operations that dominate); element-wise and normalization operations are not counted.",
    "2. A module's numbers include its submodules' and any functional calls it makes (e.g. a loss).",
    "3. Latencies come from a forward without FLOP counting (counting slows each operation); they are "
    "measured at the module's forward call, so the top module's is below the engine's fwd latency.",
    ""]


def write_lines(lines: list[str], output_file: Any = None) -> None:
    """Print `lines`, or write them to the file `output_file` (its folder is created)."""
    text = "\n".join(lines)
    if not output_file:
        print(text, flush=True)
        return
    import os

    folder = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(folder, exist_ok=True)
    with open(output_file, "w") as f:
        f.write(text + "\n")
