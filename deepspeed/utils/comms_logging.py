"""The comms logger (`comms_logger` config section): latency and bandwidth of each collective,
by operation and message size; `deepspeed.comm.log_summary()` prints it (upstream's names).

[Note: what the comms logger measures]
- A logged collective is completed before it returns (`Work.wait()`, and a device synchronize
  for device tensors), as upstream's logger does, so its latency is the whole operation. This
  removes the overlap of reductions with backward: turn the logger on to study collectives,
  not to time training. `deepspeed.comm.comms_counter` counts every call and byte at no cost.
- Message size S is the full logical message: the tensor an all-reduce reduces, the input of a
  reduce-scatter, the output of an all-gather. Algorithmic bandwidth is S / latency and bus
  bandwidth is algbw x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter, all-gather and
  all-to-all, x 1 otherwise (nccl-tests' definitions), n being the size of the op's group.
  Upstream counts an all-gather's message as the input and multiplies by the world size, which
  gives the same algbw; its all-reduce "tput" is 2S / latency and it scales reduce-scatter by
  the world size twice; the figures here follow nccl-tests instead. Bandwidths are in Gbps.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)")
_STRAGGLER_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                      "Avg comm lat(ms)", "Avg straggler(ms)")


def convert_size(size_bytes: int) -> str:
    """`1.5 KB`-style size (powers of 1024, upstream's format)."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def calc_bw_log(comm_op: str, size: int, duration: float, group_size: int | None = None) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of a `size`-byte `comm_op` that took `duration` milliseconds."""
    if group_size is None:
        from .. import comm as dist

        group_size = dist.get_world_size()
    from ..comm.counting import WIRE_FACTOR   # (here: deepspeed.comm imports this module)

    # nccl-tests' bus factor is the ring's share of the message each rank sends, except that a
    # broadcast's bus bandwidth is its algorithmic one
    factor = WIRE_FACTOR.get("all_reduce" if comm_op == "inference_all_reduce" else comm_op)
    algbw = size / duration * 8 / 1e6 if duration > 0 else 0.0   # bytes/ms -> Gbit/s
    return algbw, algbw * (factor(max(group_size, 1)) if factor is not None and comm_op != "broadcast" else 1.0)


def get_caller_func(frame: int = 3) -> str:
    """Name of the first function outside deepspeed.comm on the stack (for `debug` records)."""
    f = sys._getframe(1)
    while f is not None and (f.f_globals.get("__name__", "").startswith(("deepspeed.comm", __name__))):
        f = f.f_back
    return f.f_code.co_name if f is not None else "?"


class CommsLogger:
    """Records `{record name: {message size: [count, [latency ms], [algbw], [busbw]]}}` (upstream's
    layout). See [Note: what the comms logger measures]."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.paused = False           # set while log_summary runs its own collectives
        self._lock = threading.Lock()

    def configure(self, comms_config: Any) -> None:
        """Apply a `comms_logger` section (upstream: only when it is enabled)."""
        if not getattr(comms_config, "enabled", False):
            return
        self.enabled = True
        self.verbose, self.debug = comms_config.verbose, comms_config.debug
        self.prof_all, self.prof_ops = comms_config.prof_all, list(comms_config.prof_ops)

    def wants(self, op: str) -> bool:
        return self.enabled and not self.paused and (self.prof_all or op in self.prof_ops)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int,
               group_size: int | None = None) -> None:
        """Add one collective: `latency` in milliseconds, `msg_size` in bytes."""
        if self.debug:
            record_name = f"{record_name} | [Caller Func: {get_caller_func()}]"
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency, group_size)
        with self._lock:
            entry = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
            entry[0] += 1
            entry[1].append(latency)
            entry[2].append(algbw)
            entry[3].append(busbw)
        if self.verbose:
            from .logging import log_dist

            log_dist(f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                     f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", [0])

    # --- queries (upstream's) -------------------------------------------------------------
    def get_raw_data(self) -> dict:
        with self._lock:
            return {k: {s: [v[0], list(v[1]), list(v[2]), list(v[3])] for s, v in d.items()}
                    for k, d in self.comms_dict.items()}

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        with self._lock:
            self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(v[0] for d in self.comms_dict.values() for v in d.values())

    def get_operation_summary(self, operation_name: str) -> dict | None:
        data = self.get_raw_data().get(operation_name)
        return None if data is None else {size: _stats(size, vals) for size, vals in data.items()}

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False) -> dict | None:
        """Print (and/or return) the table; `show_straggler` is collective (every rank must call)."""
        import datetime

        from .. import comm as dist

        data = self.get_raw_data()
        result = {"summary": {op: {size: _stats(size, vals) for size, vals in sorted(sizes.items())}
                              for op, sizes in data.items()},
                  "straggler_analysis": None,
                  "metadata": {"world_size": dist.get_world_size(), "rank": dist.get_rank(),
                               "timestamp": datetime.datetime.now().isoformat()}}
        lines = [_row(_COLUMNS)]
        for op, sizes in result["summary"].items():
            lines.append(op)
            lines += [_row(("", s["msg_size_str"], s["count"], f"{s['total_latency_ms']:.2f}",
                            f"{s['avg_latency_ms']:.2f}", f"{s['tput_avg_gbps']:.2f}", f"{s['busbw_avg_gbps']:.2f}"))
                      for s in sizes.values()]
        if show_straggler:
            result["straggler_analysis"] = _stragglers(data)
            lines += ["_______________________________", "Breakdown with straggler effect",
                      "-------------------------------", _row(_STRAGGLER_COLUMNS)]
            for op, sizes in result["straggler_analysis"].items():
                lines.append(op)
                lines += [_row(("", s["msg_size_str"], s["count"], f"{s['total_comm_lat_ms']:.2f}",
                                f"{s['total_straggler_ms']:.2f}", f"{s['avg_comm_lat_ms']:.2f}",
                                f"{s['avg_straggler_ms']:.2f}")) for s in sizes.values()]
        if print_log:
            print("\n".join(lines), flush=True)
        return result if return_dict else None


def _row(cells: tuple) -> str:
    return "".join(f"{str(c): <20}" for c in cells)


def _stats(size: int, vals: list[Any]) -> dict[str, Any]:
    from .timer import trim_mean

    return {"count": vals[0], "total_latency_ms": sum(vals[1]), "avg_latency_ms": trim_mean(vals[1], 0.1),
            "tput_avg_gbps": trim_mean(vals[2], 0.1), "busbw_avg_gbps": trim_mean(vals[3], 0.1),
            "msg_size_bytes": size, "msg_size_str": convert_size(size)}


def _stragglers(data: dict) -> dict:
    """Per op and size: the fastest rank's latencies (all-reduce MIN) and how much longer this
    rank's were. Every rank must have logged the same ops, sizes and counts (checked first)."""
    import torch

    from .. import comm as ds_comm
    from ..accelerator import get_accelerator
    from .timer import trim_mean

    device = get_accelerator().current_device_name()
    shape = sorted((op, size, vals[0]) for op, sizes in data.items() for size, vals in sizes.items())
    shapes: list[Any] = [None] * ds_comm.get_world_size()
    ds_comm.all_gather_object(shapes, shape)
    if any(s != shape for s in shapes):
        raise RuntimeError("log_summary(show_straggler=True): the ranks logged different collectives "
                           "(op, message size, count); the straggler analysis needs the same on every rank")
    found = {}
    for op, size, count in shape:   # the same order on every rank: the collectives pair up
        lats = torch.tensor(data[op][size][1], dtype=torch.float64, device=device)
        fastest = lats.clone()
        ds_comm.all_reduce(fastest, op=ds_comm.ReduceOp.MIN)
        late = lats - fastest
        found[op, size] = {
            "count": count, "total_comm_lat_ms": float(fastest.sum()), "total_straggler_ms": float(late.sum()),
            "avg_comm_lat_ms": trim_mean(fastest.cpu().tolist(), 0.1),
            "avg_straggler_ms": trim_mean(late.cpu().tolist(), 0.1),
            "msg_size_bytes": size, "msg_size_str": convert_size(size)}
    return {op: {size: found[op, size] for size in sorted(sizes)} for op, sizes in data.items()}
