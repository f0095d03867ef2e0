"""Generation under ZeRO-3: gather the whole model once instead of per layer and per token.

`unwrap_model_for_generation(engine)` gathers every parameter for the block and takes the ZeRO-3
forward hooks off the module, so ``model.generate()`` runs as a plain module; on exit the hooks go
back on and the parameters are released. Other stages need nothing: the module is yielded as is.

RL libraries (TRL and its copies) do the same by hand through upstream's internals:
``engine.optimizer.parameter_offload`` with ``forward_hooks``/``backward_hooks`` lists they empty,
``_register_deepspeed_module(module)`` (DeepSpeed >= 0.16.4; ``_register_hooks_recursively`` before)
to restore, ``param_coordinator.is_invalid_trace()``/``_invalidate_trace()`` around it,
``param.ds_active_sub_modules.clear()`` and ``module.ds_external_parameters()``.
`ParameterOffloadView` maps those names onto our coordinator (docs/client_surface.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from .stage3.units import external_parameters


class ParameterOffloadView:
    """Upstream's ``DeepSpeedZeRoOffload`` surface over a Stage3Coordinator. `forward_hooks` are the
    coordinator's module hooks (removing them and emptying the list leaves the module unhooked);
    our backward hooks are armed by the forward hooks, so `backward_hooks` is always empty. It is
    `optimizer.parameter_offload` of a training engine and, as upstream, `engine.optimizer` itself
    of a ZeRO-3 engine built without an optimizer."""

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

    @property
    def param_coordinator(self) -> Any:
        """Upstream's PartitionedParameterCoordinator; here the prefetcher, whose recorded trace is
        what upstream's `is_invalid_trace()`/`_invalidate_trace()` ask about."""
        return self._coordinator.prefetcher

    def _register_hooks_recursively(self, module: nn.Module | None = None, count: Any = None) -> None:
        """Put the forward hooks back: all of the engine's model's (installing them again
        replaces them, so a second call adds none). Only the engine's model is accepted: our
        hooks are per model, not per submodule."""
        if module is not None and module is not self.module:
            raise ValueError(f"parameter_offload: re-registering ZeRO-3 hooks on a {type(module).__name__} that "
                             f"is not the engine's model ({type(self.module).__name__}); the hooks are "
                             "installed for the whole model: pass parameter_offload.module")
        self._coordinator._install_forward_hooks()

    _register_deepspeed_module = _register_hooks_recursively   # DeepSpeed >= 0.16.4's name, which TRL calls


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
    optimizer = getattr(model, "optimizer", None)   # at ZeRO-3 without an optimizer: the view itself
    offload = optimizer if isinstance(optimizer, ParameterOffloadView) else getattr(optimizer, "parameter_offload", None)
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
