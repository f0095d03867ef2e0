# compat: upstream deepspeed.ops.op_builder. Upstream compiles C++/CUDA ops through these builders;
# this build has none to compile. Where an op has a PyTorch equivalent here (the optimizers in
# deepspeed.ops), its builder reports itself compatible, so code and tests that gate on
# `deepspeed.ops.__compatible_ops__[XBuilder.NAME]` run against that equivalent; `load()` never
# compiles and says where the equivalent is.
"""Op builders: names and compatibility of upstream's compiled ops in this pure-Python build."""

from __future__ import annotations

from typing import Any


class OpBuilder:
    """An op upstream builds from C++/CUDA sources. `python_equivalent` names the module of this
    build that does the same work in PyTorch, or is empty where there is none."""

    NAME = "deepspeed_not_implemented"
    python_equivalent = ""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def sources(self) -> list[str]:
        return []

    def include_paths(self) -> list[str]:
        return []

    def is_compatible(self, verbose: bool = False) -> bool:
        return bool(self.python_equivalent)

    def builder(self) -> Any:
        raise RuntimeError(self._no_build())

    def jit_load(self, verbose: bool = True) -> Any:
        raise RuntimeError(self._no_build())

    def load(self, verbose: bool = True) -> Any:
        raise RuntimeError(self._no_build())

    def _no_build(self) -> str:
        where = (f" Its PyTorch equivalent is in {self.python_equivalent}." if self.python_equivalent
                 else " This build has no equivalent of it.")
        return f"op '{self.name}': this pure-Python build of deepspeed compiles no C++/CUDA ops.{where}"


def _builder(class_name: str, name: str, equivalent: str = "") -> type:
    return type(class_name, (OpBuilder,), {"NAME": name, "python_equivalent": equivalent,
                                           "__doc__": f"Upstream's '{name}' op."})


_OPS = {  # class name: (op name, module of the PyTorch equivalent here)
    "CPUAdamBuilder": ("cpu_adam", "deepspeed.ops.adam (DeepSpeedCPUAdam)"),
    "CPUAdagradBuilder": ("cpu_adagrad", "deepspeed.ops.adagrad (DeepSpeedCPUAdagrad)"),
    "CPULionBuilder": ("cpu_lion", "deepspeed.ops.lion (DeepSpeedCPULion)"),
    "FusedAdamBuilder": ("fused_adam", "deepspeed.ops.adam (FusedAdam)"),
    "FusedLambBuilder": ("fused_lamb", "deepspeed.ops.lamb (FusedLamb)"),
    "FusedLionBuilder": ("fused_lion", "deepspeed.ops.lion (FusedLion)"),
    "AsyncIOBuilder": ("async_io", "deepspeed.ops.aio (aio_handle, in Python over the OS)"),
    "GDSBuilder": ("gds", ""),
    "PinMemoryBuilder": ("pin_memory", ""),
    "UtilsBuilder": ("utils", ""),
    "TransformerBuilder": ("transformer", "deepspeed.ops.transformer (DeepSpeedTransformerLayer)"),
    "StochasticTransformerBuilder": ("stochastic_transformer", "deepspeed.ops.transformer (stochastic_mode=True)"),
    "InferenceBuilder": ("transformer_inference", ""),
    "SpatialInferenceBuilder": ("spatial_inference", ""),
    "InferenceCoreBuilder": ("inference_core_ops", ""),
    "InferenceCutlassBuilder": ("cutlass_ops", ""),
    "RaggedOpsBuilder": ("ragged_device_ops", ""),
    "RaggedUtilsBuilder": ("ragged_ops", ""),
    "QuantizerBuilder": ("quantizer", ""),
    "FPQuantizerBuilder": ("fp_quantizer", ""),
    "SparseAttnBuilder": ("sparse_attn", ""),
    "RandomLTDBuilder": ("random_ltd", ""),
    "EvoformerAttnBuilder": ("evoformer_attn", ""),
    "ShareMemCommBuilder": ("deepspeed_shm_comm", ""),
    "CCLCommBuilder": ("deepspeed_ccl_comm", ""),
    "DeepCompileBuilder": ("dc", ""),
    "NotImplementedBuilder": ("deepspeed_not_implemented", ""),
}
for _class_name, (_name, _equivalent) in _OPS.items():
    globals()[_class_name] = _builder(_class_name, _name, _equivalent)



class AsyncIOBuilder(globals()["AsyncIOBuilder"]):
    """Upstream's 'async_io' op: `load()` returns deepspeed.ops.aio, whose `aio_handle` is the
    DeepNVMe handle implemented over the OS (deepspeed/ops/aio/handle.py), with no build."""

    def load(self, verbose: bool = True) -> Any:
        from .. import aio

        return aio

    jit_load = load


ALL_OPS = {name: globals()[cls]() for cls, (name, _) in _OPS.items()}
__all__ = ["OpBuilder", "ALL_OPS", *_OPS]
