# compat: marker base classes that libraries check with isinstance(), and the ZeRO optimizer API of seed 003.
"""`DeepSpeedOptimizer` and `ZeROOptimizer` (upstream names), and `EngineOptimizer`: the API of
upstream's ZeRO optimizer base (seed 003, `base_optimizer.py`) on every wrapper the engine builds
(stage 0 fp16/bf16, ZeRO 1-3).

[Note: the optimizer's backward API]
Upstream's ZeRO optimizers keep their own backward state (hook counters, an active depth, post
hooks). Ours has one state machine, the engine's (backward_hooks.py: one prologue and one
epilogue per backward, however it starts), so these names are thin views onto it through a weak
reference to the engine, and mean:

- `register_grad_acc_post_hook(hook)`: `hook()` runs at the end of every backward of the engine,
  once all its gradients arrived and their reduction finished (the same list as
  `engine.register_grad_acc_post_hook`); `unregister_grad_acc_post_hooks()` empties it;
  `run_grad_acc_post_hooks()` runs them now if a backward is active, else does nothing.
- `backward(loss)`: upstream's optimizer-level backward: the loss scale (fp16) is applied, not
  1/gradient_accumulation_steps (upstream's engine divides before it calls the optimizer), so
  `engine.backward(loss)` equals `engine.optimizer.backward(loss / gas)`.
- The same in parts: `backward_prologue(loss)` starts the engine's backward (at a boundary it arms
  gradient reduction) and returns the loss scaled for backward; `enter_backward()` /
  `exit_backward()` bracket a backward the caller drives (the engine's output hooks then leave the
  gradients as they come: no 1/gas, no loss scale); `backward_epilogue()` finishes it (waits for
  the reductions, runs the post hooks; a second call is a no-op). `exit_backward()` leaving the
  outermost bracket runs the epilogue if nobody did.
"""

from __future__ import annotations

from typing import Any

import torch


class DeepSpeedOptimizer:
    """Base of every optimizer wrapper the engine creates (fp16/bf16 wrappers, ZeRO)."""


class EngineOptimizer(DeepSpeedOptimizer):
    """A wrapper bound (weakly) to its engine; see [Note: the optimizer's backward API]."""

    _engine_ref: Any = None   # weakref to the engine, set by engine_setup.wrap_optimizer

    def _live_engine(self) -> Any:
        return self._engine_ref() if self._engine_ref is not None else None

    def _engine(self, what: str) -> Any:
        engine = self._live_engine()
        if engine is None:
            raise RuntimeError(f"{type(self).__name__}.{what}(): the optimizer's engine is gone")
        return engine

    # --- gradient-accumulation post hooks ---------------------------------------------------
    def register_grad_acc_post_hook(self, hook: Any) -> None:
        """Run `hook()` at the end of every backward, after its gradients are reduced."""
        self._engine("register_grad_acc_post_hook").register_grad_acc_post_hook(hook)

    def unregister_grad_acc_post_hooks(self) -> None:
        """Remove every registered post hook."""
        self._engine("unregister_grad_acc_post_hooks")._bstate.post_hooks.clear()

    def run_grad_acc_post_hooks(self) -> None:
        """Run the post hooks now if a backward is active (the epilogue runs them itself)."""
        state = self._engine("run_grad_acc_post_hooks")._bstate
        if state.active:
            state.run_post_hooks()

    # --- backward in parts ------------------------------------------------------------------
    def _begin(self, what: str) -> Any:
        engine = self._engine(what)
        if engine._bstate.begin():
            engine._backward_prologue()
        return engine

    def enter_backward(self) -> None:
        """Start (or nest into) a backward whose loss the caller scales itself."""
        state = self._begin("enter_backward")._bstate
        state.depth += 1
        state.engine_driven = True

    def exit_backward(self) -> None:
        """Leave the bracket; the outermost exit finishes the backward if no epilogue ran."""
        engine = self._engine("exit_backward")
        state = engine._bstate
        if state.depth > 0:
            state.depth -= 1
            if state.depth == 0:
                engine._backward_epilogue()

    def backward_prologue(self, loss: Any = None) -> Any:
        """Start the engine's backward; return `loss` scaled for it (loss scale, sequence share)."""
        engine = self._begin("backward_prologue")
        if loss is None:
            return None
        engine._bstate.engine_driven = True   # the caller's backward brings the scale with it
        from .sequence_loss import sequence_loss_factor

        share = sequence_loss_factor(engine, loss)   # [Note: sequence-parallel gradient scale]
        scaled = self.scale_if_loss(loss)
        return scaled * share if share != 1 else scaled

    def backward_epilogue(self, **kwargs: Any) -> None:
        """Finish the engine's backward: wait for its reductions, run the post hooks (once)."""
        self._engine("backward_epilogue")._backward_epilogue()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, **kwargs: Any) -> torch.Tensor:
        """Backward on a scalar `loss` with the loss scale, without 1/gradient_accumulation_steps
        (upstream's optimizer-level backward). Returns the loss as scaled for gradient accumulation."""
        return self._engine("backward").backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    # --- what the reduction uses ------------------------------------------------------------
    def get_param_comm_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The dtype `param`'s gradient is reduced in (communication_data_type, torch_autocast's
        rule, else the parameter's dtype; ZeRO++ qgZ sends int8 whatever this says)."""
        engine = self._engine("get_param_comm_dtype")
        if engine._stage3 is not None:
            return engine._stage3.reducer.comm_dtype or param.dtype
        return engine.precision.comm_dtype_fn()(param)

    def report_ipg_memory_usage(self, tag: str, param_elems: int, dtype: torch.dtype | None = None) -> dict:
        """Memory report with the fill of the gradient bucket being reduced (upstream's "ipg"
        bucket), printed when `memory_breakdown` is on. Returns {comm dtype: (elements in the
        bucket, percent of reduce_bucket_size with `param_elems` more)}."""
        from .memory_report import see_memory_usage

        engine = self._engine("report_ipg_memory_usage")
        fill = engine._stage3.reducer.bucket_fill() if engine._stage3 is not None else \
            engine._reducer.bucket_fill() if engine._reducer is not None else {}
        cap = max(int(engine._config.model.zero_optimization.reduce_bucket_size), 1)
        report = {}
        for dt, elements in fill.items():
            if dtype is None or dt == dtype:
                report[dt] = (elements, (100 * (elements + param_elems)) // cap)
                see_memory_usage(f"{tag}: elems in_bucket {dt} {elements} param {param_elems} max_percent "
                                 f"{report[dt][1]}", force=bool(engine.memory_breakdown()))
        return report

    # --- universal checkpoints --------------------------------------------------------------
    def load_hp_checkpoint_state_from_checkpoint_dir(self, lp_groups_name: str, checkpoint_dir: str) -> None:
        """Load this rank's fp32 masters, optimizer state (step included), param-group settings and
        loss scaler from a universal checkpoint directory (`ds_to_universal`'s output: `zero/<param
        name>/*.pt` and `zero/optimizer_state.pt`). The module's own (low-precision) weights are not
        touched; the next step writes the masters into them. `lp_groups_name` names upstream's
        parameter-group attribute and is not needed here."""
        self._engine("load_hp_checkpoint_state_from_checkpoint_dir")._load_hp_state(checkpoint_dir)


class ZeROOptimizer(EngineOptimizer):
    """Base of the ZeRO optimizers (stages 1-3)."""
