"""The backward state machine: one prologue and one epilogue per backward, however it is started.

[Note: PyTorch-compatible backward]
`engine.backward(loss)`, `loss.backward()` and `out.backward(grad)` must give the same
gradients. The engine registers a tensor hook on every floating output of its forward; the
first one to receive a gradient runs the prologue (arm gradient reduction at an accumulation
boundary) and queues the epilogue as a callback on the autograd engine, which runs when the
whole graph task ends. The hook also divides the incoming gradient by
gradient_accumulation_steps and multiplies it by the loss scale, unless engine.backward
(which scales the loss itself) or engine.scale(loss) already did.

Why a callback and not hook counting: with reentrant activation checkpointing, gradient hooks
fire in phases, the later ones inside nested backward calls; the outer graph task ends only
after all of them, so the epilogue cannot run after phase 1. A custom autograd Function that
calls torch.autograd.backward from its forward never reaches the engine's outputs, so it
cannot start a prologue and cannot trigger the epilogue.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def queue_autograd_callback(fn: Callable[[], None]) -> bool:
    """Queue `fn` to run when the current autograd graph task finishes; False if impossible."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        return False
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None or current() == -1:
        return False
    engine.queue_callback(fn)
    return True


def in_autograd_backward() -> bool:
    """True while an autograd graph task runs on this thread (a backward, or a reentrant
    checkpoint's recompute inside one)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def under_function_transform() -> bool:
    """True inside torch.func.grad/vjp/jacrev/vmap: their autograd computes gradients of the
    transformed function only (no parameter gradients, no optimizer step), so the engine's output
    hooks (1/gas scaling, the backward prologue and epilogue) must stay out of it."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Floating tensors that need grad inside a forward's (nested) output."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            if item.requires_grad and item.is_floating_point():
                found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, name) for name in item.__dataclass_fields__)
    return found


def derived_outputs(tensors: list[torch.Tensor], max_nodes: int = 256) -> dict[int, list[int]]:
    """For each output index, the indices of other outputs it is computed from.

    A model returning `(loss, logits)` (Hugging Face's ModelOutput) makes `loss.backward()`
    reach the logits' hook with a gradient the loss's hook already scaled; the logits' hook
    must then not scale again. The walk is bounded: such a loss sits a few nodes above its
    logits, and independent outputs need not be told apart exhaustively.
    """
    if len(tensors) < 2:
        return {}
    node_of = {t.grad_fn: i for i, t in enumerate(tensors) if t.grad_fn is not None}
    found: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        seen, frontier, hits = set(), [t.grad_fn], []
        while frontier and len(seen) < max_nodes:
            node = frontier.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in node_of and node_of[node] != i:
                hits.append(node_of[node])
                continue
            frontier.extend(fn for fn, _ in node.next_functions)
        if hits:
            found[i] = hits
    return found


class BackwardState:
    """Whether this engine is inside a backward, and what that backward still has to do."""

    def __init__(self) -> None:
        self.active = False              # a prologue ran and its epilogue did not yet
        self.engine_driven = False       # engine.backward (or the optimizer's API) drives: the loss is already scaled
        self.depth = 0                   # optimizer.enter_backward() brackets open in this backward
        self.loss_prescaled = False      # engine.scale(loss) applied the loss scale in this backward
        self.callback_queued = False
        self.scaled_upstream: set[int] = set()  # ids of outputs whose gradient arrives already scaled
        self.post_hooks: list[Callable[[], None]] = []

    def begin(self) -> bool:
        """Enter a backward; True if this call started it (so the caller runs the prologue)."""
        if self.active:
            return False
        self.active = True
        self.callback_queued = False
        return True

    def end(self) -> bool:
        """Leave the backward; True if it was active (so the caller runs the epilogue once)."""
        if not self.active:
            return False
        self.active = False
        self.engine_driven = False
        self.depth = 0
        self.loss_prescaled = False
        self.callback_queued = False
        self.scaled_upstream.clear()
        return True

    def run_post_hooks(self) -> None:
        for hook in self.post_hooks:
            hook()
