"""Generation under ZeRO-3: gather the whole model once instead of per layer and per token.

`unwrap_model_for_generation(engine)` gathers every parameter for the block and takes the ZeRO-3
forward hooks off the module, so ``model.generate()`` runs as a plain module; on exit the hooks go
back on and the parameters are released. Other stages need nothing: the module is yielded as is.

RL libraries (TRL and its copies) do the same by hand through upstream's internals:
``engine.optimizer.parameter_offload`` with ``forward_hooks``/``backward_hooks`` lists they empty,
``_register_hooks_recursively(module)`` to restore, ``param.ds_active_sub_modules.clear()`` and
``module.ds_external_parameters()``. `ParameterOffloadView` maps those names onto our coordinator.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from .stage3.units import external_parameters


class ParameterOffloadView:
    """Upstream's ``DeepSpeedZeRoOffload`` surface over a Stage3Coordinator. `forward_hooks` are the
    coordinator's module hooks (removing them and emptying the list leaves the module unhooked);
    our backward hooks are armed by the forward hooks, so `backward_hooks` is always empty."""

    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator
        self.module = coordinator.module
        self.backward_hooks: list[Any] = []
        for module in self.module.modules():
            if "ds_external_parameters" not in module.__dict__:
                module.ds_external_parameters = _ExternalParameters(module)

    @property
    def forward_hooks(self) -> list[Any]:
        return self._coordinator._forward_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[Any]) -> None:
        self._coordinator._forward_handles = list(handles)

    def _remove_module_hooks(self) -> None:
        for handle in self.forward_hooks:
            handle.remove()
        self.forward_hooks = []

    def _register_hooks_recursively(self, module: nn.Module | None = None, count: Any = None) -> None:
        """Put the forward hooks back (all of them: `module` is always the engine's model here)."""
        self._coordinator._install_forward_hooks()

    def _register_deepspeed_module(self, module: nn.Module | None = None, count: Any = None) -> None:
        """DeepSpeed 0.19's name for `_register_hooks_recursively` (TRL's `add_hooks` calls it)."""
        self._register_hooks_recursively(module, count)


class _ExternalParameters:
    """``module.ds_external_parameters()``: (key, parameter) pairs, as upstream's dict items."""

    def __init__(self, module: nn.Module) -> None:
        import weakref

        self._module = weakref.ref(module)

    def __call__(self) -> list[tuple[str, nn.Parameter]]:
        module = self._module()
        return [] if module is None else [(str(id(p)), p) for p in external_parameters(module)]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield `model` (an engine or module) with every ZeRO-3 parameter gathered and no ZeRO-3 hooks;
    a collective at ZeRO-3 (every rank enters it). Training may resume right after the block."""
    offload = getattr(getattr(model, "optimizer", None), "parameter_offload", None)
    coordinator = getattr(model, "_stage3", None)   # ZeRO-3 without an optimizer (inference)
    if offload is None and coordinator is not None:
        offload = ParameterOffloadView(coordinator)
    if offload is None:
        yield model
        return
    from .stage3.gathered import GatheredParameters

    with GatheredParameters(list(offload.module.parameters())):
        offload._remove_module_hooks()
        try:
            yield model
        finally:
            offload._register_hooks_recursively(offload.module)


__all__ = ["unwrap_model_for_generation", "ParameterOffloadView"]
