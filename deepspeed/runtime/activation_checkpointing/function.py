"""The checkpointed region itself: reentrant (`CheckpointFunction`) and non-reentrant.

Both run the region once in forward without keeping its intermediate activations and run it
again during backward. What makes the two runs identical (bit for bit, so dropout masks and
therefore gradients equal those of an uncheckpointed run) is the `RngSnapshot` taken before the
first and installed around the second, plus the autocast state of the first run re-entered for
the second (backward runs outside the user's `torch.autocast`).

Reentrant: an autograd.Function whose backward recomputes under grad and runs a nested
`torch.autograd.backward`; its inputs are kept as `stash.py` says (partitioned, on CPU, in a
contiguous buffer). Non-reentrant: torch.utils.checkpoint(use_reentrant=False) with our RNG and
autocast handling as its `context_fn`; with stashing options on, the region's tensor inputs reach
it only through the stash, so the originals are not kept alive by the recompute closure.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ...accelerator import get_accelerator
from .rng import RngSnapshot
from .stash import InputStash
from .state import ActivationCheckpointing, current


def _autocast_states() -> list[tuple[str, bool, torch.dtype, bool]]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
            for d in devices]


@contextlib.contextmanager
def _autocast_as(states: list[tuple[str, bool, torch.dtype, bool]]) -> Iterator[None]:
    """Re-enter the recorded autocast states; a device already in its recorded state (the usual
    case: autocast off in forward and in backward) is left alone, which saves a torch.autocast."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype, cache in states:
            now_enabled = torch.is_autocast_enabled(device)
            if enabled == now_enabled and (not enabled or dtype == torch.get_autocast_dtype(device)):
                continue
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


def _label(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def _bind_kwargs(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Keyword arguments become trailing positional ones, so tensors among them get gradients."""
    if not kwargs:
        return function, args
    names, n = list(kwargs), len(args)

    def bound(*flat: Any) -> Any:
        return function(*flat[:n], **dict(zip(names, flat[n:])))

    bound.__qualname__ = _label(function)
    return bound, args + tuple(kwargs[k] for k in names)


class CheckpointFunction(torch.autograd.Function):
    """Reentrant activation checkpointing, upstream's `apply(run_function, all_outputs, *args)`
    call. `apply` returns the output's tensors; `all_outputs` receives `(leaves, treespec)` of the
    whole output (torch.utils._pytree), from which `checkpoint()` rebuilds it with non-tensors in
    place (upstream appends the top-level outputs instead)."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable, all_outputs: list, *args: Any) -> Any:
        owner = current()
        ctx.owner, ctx.run_function = owner, run_function
        ctx.label = _label(run_function)
        ctx.rng = RngSnapshot.capture(owner.rng_tracker)
        ctx.autocast = _autocast_states()
        with owner.phase("forward", ctx.label):
            outputs = run_function(*args)
        _keep_inputs(ctx, owner, args)
        leaves, spec = ([outputs], None) if torch.is_tensor(outputs) else pytree.tree_flatten(outputs)
        all_outputs.append((leaves, spec))
        tensors = [t for t in leaves if torch.is_tensor(t)]
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("deepspeed.checkpointing.checkpoint is incompatible with torch.autograd.grad(); "
                               "use .backward(), or non_reentrant_checkpoint")
        owner: ActivationCheckpointing = ctx.owner
        inputs = _restore_inputs(ctx)
        with owner.phase("recompute", ctx.label), ctx.rng.replayed(owner.rng_tracker):
            with torch.enable_grad(), _autocast_as(ctx.autocast):
                outputs = ctx.run_function(*inputs)
        leaves = [outputs] if torch.is_tensor(outputs) else [t for t in pytree.tree_leaves(outputs)
                                                             if torch.is_tensor(t)]
        pairs = [(t, g) for t, g in zip(leaves, grads) if t.requires_grad and g is not None]
        if not pairs:
            raise RuntimeError("deepspeed.checkpointing.checkpoint: no output of the checkpointed region requires "
                               "grad, so checkpointing it is not necessary")
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(x.grad if torch.is_tensor(x) else None for x in inputs)
        return (None, None) + input_grads


def _keep_inputs(ctx: Any, owner: ActivationCheckpointing, args: tuple) -> None:
    """Plain: save_for_backward (so in-place changes are caught); stashing: see stash.py."""
    ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
    ctx.others = [None if torch.is_tensor(a) else a for a in args]
    tensors = [args[i] for i in ctx.tensor_at]
    plan = owner.stash_plan()
    if plan.changes_anything:
        ctx.stash = InputStash(tensors, plan)
        owner.record_kept(ctx.stash.input_nbytes, ctx.stash.kept_nbytes)
    else:
        ctx.stash = None
        ctx.save_for_backward(*tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        owner.record_kept(nbytes, nbytes)


def _restore_inputs(ctx: Any) -> list:
    if ctx.stash is not None:
        tensors = ctx.stash.restore()
    else:
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
    inputs = list(ctx.others)
    for i, t in zip(ctx.tensor_at, tensors):
        inputs[i] = t
    return inputs


def reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint `function(*args, **kwargs)` with `CheckpointFunction`; returns its output with
    the same structure (tensors, tuples, lists, dicts, non-tensors)."""
    if not torch.is_grad_enabled():   # eval: no backward, nothing to keep
        return function(*args, **kwargs)
    function, args = _bind_kwargs(function, args, kwargs)
    all_outputs: list = []
    tensors = iter(CheckpointFunction.apply(function, all_outputs, *args))
    leaves, spec = all_outputs[0]
    if spec is None:   # a single tensor
        return next(tensors)
    return pytree.tree_unflatten([next(tensors) if torch.is_tensor(x) else x for x in leaves], spec)


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint `function(*args, **kwargs)` without a nested backward (works with
    torch.autograd.grad and with inputs that do not require grad)."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    owner = current()
    label = _label(function)
    rng = RngSnapshot.capture(owner.rng_tracker)
    autocast = _autocast_states()

    def context_fn() -> tuple[Any, Any]:
        return owner.phase("forward", label), _Recompute(owner, label, rng, autocast)

    plan = owner.stash_plan()
    if not plan.changes_anything:
        nbytes = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
        owner.record_kept(nbytes, nbytes)
        return torch_checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                preserve_rng_state=False, **kwargs)
    function, args = _bind_kwargs(function, args, kwargs)
    tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
    stash = InputStash([args[i] for i in tensor_at], plan)
    owner.record_kept(stash.input_nbytes, stash.kept_nbytes)
    first = {"args": args}   # the forward uses the originals; only the recompute restores the stash

    def replay(*_kept: torch.Tensor) -> Any:
        call = first.pop("args", None)
        if call is None:
            call = list(args_without_tensors)
            for i, t in zip(tensor_at, stash.restore()):
                call[i] = t
        return function(*call)

    args_without_tensors = [None if torch.is_tensor(a) else a for a in args]
    # no tensor argument: the accelerator's device, as torch's checkpoint assumes ("cuda" there)
    args_device = args[tensor_at[0]].device if tensor_at else get_accelerator().device()
    del args
    # torch infers the device type (for its autocast handling) from the arguments: an empty tensor
    # on the inputs' device says it without handing torch the kept pieces, whose version counters
    # a contiguous buffer bumps when the next region copies in
    device_hint = torch.empty(0, device=args_device)
    return torch_checkpoint(replay, device_hint, use_reentrant=False, context_fn=context_fn,
                            preserve_rng_state=False)


class _Recompute:
    """The recompute context handed to torch: entered only when (and each time) torch
    recomputes, so it must be reusable (a second backward with retain_graph recomputes again)."""

    def __init__(self, owner: ActivationCheckpointing, label: str, rng: RngSnapshot, autocast: list) -> None:
        self.owner, self.label, self.rng, self.autocast = owner, label, rng, autocast
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.owner.phase("recompute", self.label))
        stack.enter_context(self.rng.replayed(self.owner.rng_tracker))
        stack.enter_context(_autocast_as(self.autocast))
        self._stack = stack

    def __exit__(self, *exc: Any) -> Any:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)
