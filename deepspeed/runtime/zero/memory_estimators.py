"""Model-state memory estimates per device and per node, before training (upstream's
`estimate_zero2_model_states_mem_needs*` and `estimate_zero3_model_states_mem_needs*`, which the
Hugging Face DeepSpeed guide tells users to run). Same names, arguments, return values and table;
the numbers are this runtime's layout (docs/zero.md, "Memory per rank"), Ψ parameters, N ranks,
16-bit parameters, fp32 masters and Adam:

    ZeRO-2, no offload          device  2Ψ + 16Ψ/N          (params; fp32 grad shard 4Ψ/N; master + m + v 12Ψ/N)
    ZeRO-2, optimizer on CPU    device  2Ψ + 4Ψ/N           node CPU  16Ψ/nodes (master, m, v, grad copy)
    ZeRO-3, no offload          device  L + 18Ψ/N           (L: the largest layer gathered, 4 bytes/param)
    ZeRO-3, optimizer on CPU    device  L + 6Ψ/N            node CPU  16Ψ/nodes
    ZeRO-3, both on CPU         device  L                   node CPU  18Ψ/nodes

Where DeepSpeed 0.19.8's functions say otherwise (same inputs): ZeRO-2 device 2Ψ + 18Ψ/N there, and
with the optimizer offloaded it (2Ψ) and ZeRO-3 (L + 2Ψ/N) leave out the fp32 gradient shard, which
ours keeps on the device where the reduction writes it. Loading a model without `zero.Init` puts a full fp32 copy in
each process's CPU memory first (4Ψ per rank on the node); with it, one layer at a time. CPU
figures are multiplied by `additional_buffer_factor` (pinned buffers, fragmentation), as upstream's.
Transient buffers (gradient buckets, prefetched units, activations) are not model state and not
counted.
"""

from __future__ import annotations

from typing import Any

_GB = 2 ** 30


def _counts(model: Any) -> tuple[int, int]:
    """(total parameters, largest number of parameters directly owned by one module); ZeRO-3
    partitioned parameters count with their full size (`ds_numel`)."""
    def numel(p: Any) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    total = sum(numel(p) for p in model.parameters())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _check(total_params: int, num_gpus_per_node: int, num_nodes: int) -> None:
    for name, value in (("total_params", total_params), ("num_gpus_per_node", num_gpus_per_node),
                        ("num_nodes", num_nodes)):
        if not isinstance(value, int) or value < (0 if name == "total_params" else 1):
            raise ValueError(f"{name} must be a{' non-negative' if name == 'total_params' else ' positive'} "
                             f"integer, got {value!r}")


def _gb(n: float) -> str:
    return f"{n / _GB:.2f}GB"


def _banner(total_params: int, largest_layer_params: int | None, num_gpus_per_node: int, num_nodes: int) -> None:
    print("Estimated memory needed for params, optim states and gradients for a:")
    print(f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} GPU"
          f"{'s' if num_gpus_per_node > 1 else ''} per node.")
    largest = f", {int(largest_layer_params / 1e6)}M largest layer params" if largest_layer_params is not None else ""
    print(f"SW: Model with {int(total_params / 1e6)}M total params{largest}.")
    print("  per CPU  |  per GPU |   Options")


# --- ZeRO-2 ------------------------------------------------------------------------------------------
def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(CPU bytes per node, device bytes per GPU) for ZeRO-2 (and ZeRO-1 between steps)."""
    _check(total_params, num_gpus_per_node, num_nodes)
    gpus = num_gpus_per_node * num_nodes
    if cpu_offload:
        gpu = 2 * total_params + int(4 * total_params / gpus)
        cpu = max(4 * total_params * num_gpus_per_node, int(16 * total_params / num_nodes))
    else:
        gpu = 2 * total_params + int(16 * total_params / gpus)
        cpu = 4 * total_params * num_gpus_per_node
    return int(cpu * additional_buffer_factor), gpu


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for a model of `total_params` parameters (no model needed)."""
    _banner(total_params, None, num_gpus_per_node, num_nodes)
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                         additional_buffer_factor)
        print(f"  {_gb(cpu):>8} | {_gb(gpu):>8} | offload_optimizer={'cpu' if cpu_offload else 'none'}")


def estimate_zero2_model_states_mem_needs_all_live(model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for `model` (counts its parameters)."""
    total, _ = _counts(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


# --- ZeRO-3 ------------------------------------------------------------------------------------------
def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(CPU bytes per node, device bytes per GPU, bytes of the largest layer gathered) for ZeRO-3."""
    _check(total_params, num_gpus_per_node, num_nodes)
    gpus = num_gpus_per_node * num_nodes
    largest = 4 * largest_layer_params   # 16-bit parameters and gradients of the largest unit, gathered
    load = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node   # fp32 at build time
    if cpu_offload and cpu_offload_params:
        gpu = largest
        cpu = max(load, int(18 * total_params / num_nodes))
    elif cpu_offload:
        gpu = largest + int(6 * total_params / gpus)
        cpu = max(load, int(16 * total_params / num_nodes))
    else:
        gpu = largest + int(18 * total_params / gpus)
        cpu = load
    return int(cpu * additional_buffer_factor), gpu, largest


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table for a model of `total_params` parameters whose largest module owns
    `largest_layer_params` (no model needed)."""
    _banner(total_params, largest_layer_params, num_gpus_per_node, num_nodes)
    for offload_param in ("cpu", "none"):
        for offload_optimizer in ("cpu", "none"):
            if offload_param == "cpu" and offload_optimizer == "none":
                continue   # not a supported combination
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                    cpu_offload=offload_optimizer == "cpu", cpu_offload_params=offload_param == "cpu",
                    zero_init=zero_init, additional_buffer_factor=additional_buffer_factor)
                print(f"  {_gb(cpu):>8} | {_gb(gpu):>8} | offload_param={offload_param}, "
                      f"offload_optimizer={offload_optimizer}, zero_init={int(zero_init)}")


def estimate_zero3_model_states_mem_needs_all_live(model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table for `model` (counts its parameters and its largest module's)."""
    total, largest = _counts(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live"]
