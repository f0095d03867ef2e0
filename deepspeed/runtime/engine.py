"""DeepSpeedEngine: forward, backward, step and gradient accumulation over a user's model.

The engine wires plan and runtime objects together and delegates: gradient averaging to
GradBucketReducer, optimizer/scheduler construction to optimizers.py / lr_schedules.py,
legacy accessors to engine_accessors.py. State it owns: the micro/global step counters.
"""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn

from .. import comm as ds_comm
from ..utils.logging import log_dist, set_log_level_from_string
from .activation_checkpointing import state as activation_checkpointing
from .base_optimizer import DeepSpeedOptimizer
from .checkpoint.parallel_dims import _checkpoint_parallel_metadata  # noqa: F401  (upstream's name, here)
from .dataloader import DeepSpeedDataLoader
from .engine_accessors import EngineAccessors
from .engine_moe import setup_moe
from .engine_parallel import setup_parallel_groups
from .backward_hooks import (BackwardState, derived_outputs, in_autograd_backward, output_tensors,
                             queue_autograd_callback, under_function_transform)
from .engine_setup import (assert_valid_mixed_precision_config, broadcast_module_states, build_lr_scheduler,
                           build_optimizer_for_engine, build_reducer, build_stage3_coordinator, check_supported,
                           check_zero_layout, cast_module_mixed_precision, mixed_precision_dtypes,
                           prepare_module, resolve_device, wrap_optimizer)
from .errors import UsageError
from .grad_accum import is_boundary
from .optimizer_wrapper import clip_sharded_grads, counted_in_norm
from .observer import EngineObserver
from .precision.policy import PrecisionPolicy
from .sequence_loss import sequence_loss_factor
from .zero.generation import ParameterOffloadView
from .zero.offload_states import OffloadStates
from .zero.stages import STAGES


class DeepSpeedEngine(OffloadStates, EngineAccessors, nn.Module):
    """Wraps a model for data-parallel training with DeepSpeed's API.

    The constructor keeps upstream's signature: frameworks subclass and call it that way.
    """

    _mixed_precision_dtypes = mixed_precision_dtypes
    _assert_valid_mixed_precision_config = assert_valid_mixed_precision_config
    _cast_module_mixed_precision = cast_module_mixed_precision

    def __init__(self, args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
                 model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
                 mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
                 config: Any = None, config_class: Any = None, dont_change_device: bool = False) -> None:
        super().__init__()
        if model is None:
            raise ValueError("deepspeed.initialize: `model` is required (got None)")
        check_supported(config_class, type(self).__name__, optimizer)
        self._config = config_class
        if config_class.model.log_level is not None:   # the config's level for the deepspeed logger
            set_log_level_from_string(config_class.model.log_level)
        self.config = config if isinstance(config, dict) else dict(config_class.raw)
        self.mpu = mpu
        self.module = model
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if args is not None and hasattr(args, "local_rank"):
            args.local_rank = self.local_rank
        setup_parallel_groups(self, mpu, config_class)   # data / sequence / ZeRO groups (engine_parallel.py)
        setup_moe(self)   # expert groups, where expert gradients are reduced (engine_moe.py)
        self.device = resolve_device(self.local_rank)
        self.precision = PrecisionPolicy.from_config(config_class)
        self.stage = STAGES[config_class.model.zero_optimization.stage]
        if not dont_change_device:
            self.module.to(self.device)
        prepare_module(self)
        broadcast_module_states(self.module, self.seq_data_parallel_group)
        # ZeRO-3: parameters become shards gathered by module hooks; gradients are reduce-scattered
        # by those hooks during backward, so there is no GradBucketReducer (self._reducer is None).
        self._stage3 = build_stage3_coordinator(self)
        # its own deepspeed.checkpointing settings when the config has the section ([Note: one owner per engine])
        self._activation_checkpointing = activation_checkpointing.for_engine(config_class, mpu)
        self._bstate = BackwardState()
        self._output_tokens = itertools.count()

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._is_gradient_accumulation_boundary: bool | None = None
        self._global_grad_norm: float | None = None
        self._losses: list[torch.Tensor] = []
        self._reduced_this_boundary = False
        # managed_gradient_accumulation=false: every step() ends the window ([Note: unmanaged accumulation])
        self._managed = config_class.model.managed_gradient_accumulation
        self._backwards_since_step = 0
        self.inside_no_sync_ctxt = False
        self.enable_backward_allreduce = True
        self.pipeline_parallelism = False   # upstream's attribute (PipelineEngine: True)
        self.sparse_tensor_module_names: set[str] = set()   # upstream's (sparse gradients: not supported)
        self.client_optimizer, self.client_lr_scheduler = optimizer, lr_scheduler
        self.basic_optimizer = build_optimizer_for_engine(self, optimizer, model_parameters)
        self._reducer = build_reducer(self)
        self.optimizer = wrap_optimizer(self)
        self._has_optimizer = self.optimizer is not None   # `optimizer` is not None at ZeRO-3 inference (below)
        if self._stage3 is not None and self.optimizer is None:
            self._stage3.keep_for_backward(False)   # nothing trains: no step would give kept units back
            self.optimizer = ParameterOffloadView(self._stage3)   # upstream's DeepSpeedZeRoOffload (RL clients)
        self.lr_scheduler = build_lr_scheduler(self, lr_scheduler)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) \
            if training_data is not None else None
        ds_comm.configure(config_class)
        # timers, throughput, monitors, FLOPs profiler, memory reports (observer.py)
        self._obs = EngineObserver(self)
        self.timers, self.tput_timer, self.monitor = self._obs.timers, self._obs.tput_timer, self._obs.monitor
        self.flops_profiler = self._obs.flops_profiler
        if self.dump_state():
            config_class.print_config()

    def _solo_bucket_params(self) -> list[nn.Parameter]:
        """Parameters that get a gradient bucket of their own (the PipelineEngine's tied weights)."""
        return []

    # --- attribute pass-through -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Attributes the engine does not define come from the wrapped module (upstream does this)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise

    # --- forward ----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward (under torch.autocast when configured).

        Outputs that need grad get a hook that makes `output.backward()` behave like
        engine.backward; see [Note: PyTorch-compatible backward] in backward_hooks.py.
        """
        if self._bstate.active and not in_autograd_backward():
            self._abort_backward()   # the last backward raised before its epilogue
        self._refuse_if_offloaded("forward")
        self._obs.before_forward()
        inputs, kwargs = self.precision.cast_input(inputs), self.precision.cast_input(kwargs)
        with self.precision.forward_context(self.device.type), \
                activation_checkpointing.activated(self._activation_checkpointing):
            output = self.module(*inputs, **kwargs)
        if self._has_optimizer and torch.is_grad_enabled() and not under_function_transform():
            tensors = output_tensors(output)
            sources = derived_outputs(tensors)
            tokens = [next(self._output_tokens) for _ in tensors]  # unique, unlike id() of freed tensors
            for i, tensor in enumerate(tensors):
                upstream = [tokens[j] for j in sources.get(i, [])]
                tensor.register_hook(partial(self._output_grad_hook, tokens[i], upstream))
        self._obs.after_forward()
        return output

    def _output_grad_hook(self, tensor_id: int, computed_from: list[int], grad: torch.Tensor) -> torch.Tensor:
        if self._bstate.begin():
            self._backward_prologue()
            if not queue_autograd_callback(self._backward_epilogue):
                self._bstate.end()
                raise RuntimeError("tensor.backward() on engine outputs needs torch's autograd queue_callback API, "
                                   "which this torch build lacks; call engine.backward(loss) instead")
        if self._bstate.engine_driven:
            return grad
        self._bstate.scaled_upstream.update(computed_from)  # outputs this one was computed from
        if tensor_id in self._bstate.scaled_upstream:
            return grad  # reached through another output whose hook already scaled
        factor = sequence_loss_factor(self) / self.gradient_accumulation_steps()   # a known "share": x sp
        if not self._bstate.loss_prescaled:
            factor *= self.loss_scale_value()
        return grad * factor if factor != 1.0 else grad

    # --- backward ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward on `loss` (divided by gradient_accumulation_steps unless scale_wrt_gas=False).

        At an accumulation boundary the gradients are averaged across data-parallel ranks,
        bucket by bucket while backward still runs. Returns the scaled loss.
        """
        if not self._has_optimizer:
            raise RuntimeError("engine.backward() needs an optimizer: pass `optimizer` or an `optimizer` "
                               "section in the config to deepspeed.initialize")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward(loss): loss must be a scalar tensor; for non-scalar outputs call "
                             "output.backward(gradient) directly")
        self._refuse_if_offloaded("backward")
        self._losses.append(loss.detach())
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        share = sequence_loss_factor(self, loss)   # [Note: sequence-parallel gradient scale]
        if self._bstate.begin():
            self._backward_prologue()
        self._bstate.engine_driven = True
        try:
            scale = share * (self.loss_scale_value() if self.precision.needs_scaler else 1)
            (scaled * scale if scale != 1 else scaled).backward(retain_graph=retain_graph)
        except BaseException:
            self._bstate.engine_driven = False
            self._abort_backward()
            raise
        self._bstate.engine_driven = False
        self._backward_epilogue()
        return scaled

    def _abort_backward(self) -> None:
        """A backward raised: end it as its epilogue would (reductions completed, ZeRO-3 units
        released) so that a retry starts clean. Partial gradients stay accumulated, as in PyTorch."""
        if self._stage3 is not None:
            self._stage3.abort_backward()
        self._backward_epilogue()

    def _reduce_now(self) -> bool:
        """Reduce in this backward: at accumulation boundaries, or after every backward when
        gradients are sharded (ZeRO-2 keeps only this rank's slice between micro-steps)."""
        return (self._reducer is not None and self.enable_backward_allreduce and not self.inside_no_sync_ctxt
                and (self.stage.shard_gradients or (self._managed and self.is_gradient_accumulation_boundary())))

    def _backward_prologue(self) -> None:
        self._refuse_if_offloaded("backward")
        self._obs.before_backward()
        self._backwards_since_step += 1
        if self._reduce_now():
            self._reducer.arm()

    def _backward_epilogue(self) -> None:
        """Finish this backward once: wait for its gradient reductions, run post hooks.

        Runs from the autograd callback or engine.backward; calling it again (as the
        multi-model recipe of the docs does after loss.backward()) is a no-op.
        """
        if not self._bstate.end():
            return
        self._obs.before_reduce()
        if self._reducer is not None and self._reducer.armed:
            self._reducer.finish()
            self._reduced_this_boundary = True
        self._bstate.run_post_hooks()
        self._obs.after_backward()

    def register_grad_acc_post_hook(self, hook: Any) -> None:
        """Run `hook()` at the end of every backward of this engine (after gradient reduction)."""
        self._bstate.post_hooks.append(hook)

    def needs_scaler(self) -> bool:
        """True when backward needs loss scaling (fp16, torch_autocast in float16)."""
        return self.precision.needs_scaler

    def loss_scale_value(self) -> float:
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return scaler.loss_scale if scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply the loss scale for a manual `scale(loss).backward()` (upstream API); the output
        hooks then still divide by gradient_accumulation_steps but do not scale again."""
        if not self._has_optimizer:
            raise RuntimeError("engine.scale() needs an optimizer")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise UsageError(f"engine.scale(loss): loss must be a scalar tensor, got "
                             f"{tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__}; for non-scalar "
                             "outputs call output.backward(gradient) directly (the loss scale is applied for you)")
        if not self.precision.needs_scaler:
            return loss
        scaled = loss * self.loss_scale_value()
        if scaled.requires_grad:
            scaled.register_hook(self._mark_prescaled)
        return scaled

    def _mark_prescaled(self, grad: torch.Tensor) -> torch.Tensor:
        self._bstate.loss_prescaled = True
        return grad

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """Average gradients now (used when backward ran outside engine.backward)."""
        if self._reducer is not None and not self._reduced_this_boundary:
            self._reducer.arm()
            self._reducer.finish()
            self._reduced_this_boundary = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient averaging for backward passes inside the block (they only accumulate)."""
        if self.inside_no_sync_ctxt:
            raise UsageError("no_sync context manager reentry is unsupported")
        if self.stage.shard_gradients:
            raise UsageError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                             f"stage {self.zero_optimization_stage()}: gradients are reduce-scattered after every "
                             "backward; use stage 0 or 1, or plain gradient_accumulation_steps")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients locally, at every ZeRO stage
        (unlike no_sync, which stages 2-3 refuse); leaving the block reduces the sum once, bucket
        by bucket, as one boundary reduction would. Call step() after the block. If the block
        raises, nothing is reduced (stage 3 drops what the block accumulated)."""
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction() is not supported with pipeline parallelism")
        if not self._managed:
            raise UsageError("coalesce_grad_reduction() with managed_gradient_accumulation=false: step() already "
                             "reduces everything accumulated since the last step once; drop the block")
        if self.inside_no_sync_ctxt:
            raise UsageError("coalesce_grad_reduction() cannot be nested inside no_sync() or itself")
        self.inside_no_sync_ctxt = True   # backward does not arm the reducer; step() refuses
        if self._stage3 is not None:
            self._stage3.defer_reduction()
        completed = False
        try:
            yield
            completed = True
        finally:
            self.inside_no_sync_ctxt = False
            if self._stage3 is not None:
                self._stage3.end_deferred_reduction(reduce=completed)
            elif completed and self._reducer is not None:
                self._reducer.arm()
                self._reducer.finish()
                self._reduced_this_boundary = True

    def empty_partition_cache(self) -> None:
        """ZeRO-3: release the gathered parameters no forward is using (kept for a backward that
        has not run, prefetched) and empty the device cache. Other stages hold nothing to release."""
        if self._stage3 is not None:
            self._stage3.release_cache()
        from ..accelerator import get_accelerator

        get_accelerator().empty_cache()

    # --- accumulation boundary ----------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch ends an accumulation window (reduce + step)."""
        return is_boundary(self.micro_steps, self.gradient_accumulation_steps(),
                           self._is_gradient_accumulation_boundary)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the next backward (Hugging Face Accelerate drives it this way)."""
        if not self._managed:
            raise UsageError("set_gradient_accumulation_boundary() with managed_gradient_accumulation=false: the "
                             "boundary is the caller's step() call")
        self._is_gradient_accumulation_boundary = bool(is_boundary)

    # --- step ---------------------------------------------------------------------------------
    def step(self, lr_kwargs: dict | None = None) -> None:
        """At an accumulation boundary: clip, optimizer step, LR schedule, zero grads. Always counts.

        [Note: unmanaged accumulation] With managed_gradient_accumulation=false the caller owns the
        window: any number of backwards, then step(), which is always a boundary. Backwards still
        divide by gradient_accumulation_steps (unless scale_wrt_gas=False); stages 0-1 reduce what
        accumulated once, in step(); stages 2-3 reduce-scatter after every backward, as always
        (reduction is linear, so the sum is the same and the gradients stay sharded).
        global_samples advances by the micro-batches actually run."""
        if self.inside_no_sync_ctxt:
            raise UsageError("It is illegal to call Engine.step() inside no_sync context manager (or "
                             "coalesce_grad_reduction): leave the block first (its backward passes only accumulate)")
        if not self._has_optimizer:
            raise RuntimeError("engine.step() needs an optimizer: pass `optimizer` or an `optimizer` "
                               "section in the config to deepspeed.initialize")
        boundary = self.is_gradient_accumulation_boundary() if self._managed else True
        if boundary:
            self._refuse_if_offloaded("step")
        self._obs.before_step()
        self._step_applied = False
        if boundary:
            self._take_model_step(lr_kwargs)
        self._obs.after_step(boundary)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        if not self._reduced_this_boundary and not self.inside_no_sync_ctxt:
            self.allreduce_gradients()  # backward ran outside engine.backward: reduce now
        if self.stage.shard_optimizer_state and not self.stage.shard_parameters:
            check_zero_layout(self)  # (ZeRO-3's units are fixed by the coordinator; not checked yet)
        if isinstance(self.optimizer, DeepSpeedOptimizer):  # unscale, overflow skip and clip live there
            applied = self.optimizer.step()
            self._global_grad_norm = None if (norm := self.optimizer._global_grad_norm) is None else float(norm)
        else:
            clip = self.gradient_clipping()
            split = getattr(self, "_split", None)
            if getattr(self, "_tp_replicated", None) is not None:   # [Note: TP-replicated gradients]
                self._tp_replicated.average([(p.grad, p, 0) for p in self.module.parameters()], self.device)
            if clip > 0.0 and split is not None:   # pipeline stages: the norm of the whole model
                params = [p for p in self.module.parameters() if p.grad is not None]
                self._global_grad_norm = clip_sharded_grads([p.grad for p in params], clip, self.device, None, 1,
                                                            split, [counted_in_norm(p, split) for p in params])
            elif clip > 0.0:
                params = [p for p in self.module.parameters() if p.grad is not None]
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip, foreach=True) if params else None
                self._global_grad_norm = float(norm) if norm is not None else None
            self.optimizer.step()
            applied = True
        if not getattr(self.optimizer, "step_consumes_grads", False):
            self.zero_grad()
        self._step_applied = applied
        if not applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.train_batch_size() if self._managed else \
            self.train_micro_batch_size_per_gpu() * self.dp_world_size * self._backwards_since_step
        self._backwards_since_step = 0
        self._reduced_this_boundary = False
        if self._should_print():
            self._report_progress(self.global_steps)
        self._obs.on_model_step(self._losses)
        self._losses = []

    def _should_print(self) -> bool:
        every = self.steps_per_print()
        return bool(every) and self.global_steps > 0 and self.global_steps % every == 0

    def _report_progress(self, step: int, loss: float | None = None) -> None:
        if loss is None and self._losses:
            loss = torch.stack(self._losses).float().mean().item()
        shown = "" if loss is None else f"loss={loss:.4f}, "   # no loss seen on this rank: none shown
        log_dist(f"step={step}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}, "
                 f"{shown}samples/sec={self.tput_timer.avg_samples_per_sec():.1f}", ranks=[0])

    def zero_grad(self) -> None:
        """Zero parameter gradients (kept as bucket views under data parallelism)."""
        if self._reducer is not None:
            self._reducer.zero_grad()
        elif self._stage3 is not None:
            self._stage3.zero_grad()
        else:
            for p in self.module.parameters():
                p.grad = None

    # --- accessors ----------------------------------------------------------------------------
    def _get_optimizer_param(self, name: str) -> list:
        return [g[name] for g in self.optimizer.param_groups if name in g] if self._has_optimizer else []

    def get_lr(self) -> list[float]:
        return self._get_optimizer_param("lr")

    def get_mom(self) -> list:
        name = (self.optimizer_name() or "").lower()
        return self._get_optimizer_param("momentum" if name in ("sgd", "rmsprop") else "betas")

    def get_type(self) -> list:
        return self._get_optimizer_param("type")

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradients at the last step (computed when clipping is on)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps (micro batch fixed)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(f"train_batch_size ({train_batch_size}) must be divisible by "
                             f"train_micro_batch_size_per_gpu * data-parallel world size ({per_step})")
        self._config.set_batch(train_batch_size, train_batch_size // per_step)
        self.tput_timer.batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        gas = self.gradient_accumulation_steps()
        self._config.set_batch(micro_batch_size * gas * self.dp_world_size, gas, micro_batch_size)

    def get_data_parallel_rank(self) -> int:
        return ds_comm.get_rank(self.data_parallel_group)

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def get_wall_clock_timers(self) -> dict[str, float]:
        return {name: t.elapsed(reset=False) for name, t in self.timers.get_timers().items()}

    @property
    def communication_data_type(self) -> torch.dtype | None:
        return self._config.communication_dtype

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> DeepSpeedDataLoader:
        """A DataLoader that gives each data-parallel rank its share of `dataset`."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise ValueError(f"training_data must be a torch.utils.data.Dataset, got {type(dataset).__name__}")
        return DeepSpeedDataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                   pin_memory=pin_memory and self.device.type == "cuda",
                                   tput_timer=None, collate_fn=collate_fn,
                                   num_local_io_workers=num_local_io_workers, data_sampler=data_sampler,
                                   data_parallel_world_size=self.dp_world_size,
                                   data_parallel_rank=self.get_data_parallel_rank(),
                                   dataloader_drop_last=self.dataloader_drop_last())

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    # --- checkpoints (runtime/checkpoint/engine_io.py) ------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save module, optimizer, scheduler and counters under `save_dir/tag` in DeepSpeed's layout.

        Every rank must call it (each writes its optimizer partition); a call on some ranks only
        fails with an error on the ranks that called it. The previous checkpoint and `latest`
        stay intact until the new one is complete. By default a background thread writes and publishes it
        (checkpoint.async_save; docs/checkpointing.md); the next save or load and process exit wait for it.
        """
        from .checkpoint.engine_io import save_checkpoint
        return save_checkpoint(self._checkpoint_view(), save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        """Load a checkpoint saved at any world size and ZeRO stage; returns (load_path, client_state),
        (None, None) when `load_dir` has no `latest` and no tag is given."""
        from .checkpoint.engine_io import load_checkpoint

        return load_checkpoint(self._checkpoint_view(), load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    def wait_for_checkpoint(self) -> None:
        """Wait until a background save (`checkpoint.async_save`, the default) is written and published; raises on
        every rank if it failed on any. Every rank must call it. A no-op without a pending save."""
        from .checkpoint.engine_io import wait_for_checkpoint

        wait_for_checkpoint(self._checkpoint_slot)

    def _optimizer_partition_state(self) -> dict:
        """This rank's ZeRO optimizer state as save_checkpoint writes it (collective): what the ZeRO
        optimizers' `state_dict()` returns (Lightning calls it on every rank when it saves)."""
        from .checkpoint.engine_io import optimizer_partition_state

        return optimizer_partition_state(self._checkpoint_view())

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the module's weights (training dtype) to `save_dir/save_filename` on rank 0;
        `.safetensors` names write safetensors. Every rank must call it. At ZeRO stage 3 the
        weights are gathered (one unit at a time) only when
        zero_optimization.stage3_gather_16bit_weights_on_model_save is true; otherwise nothing
        is written and every rank returns False."""
        from .checkpoint.model_save import save_16bit_model

        return save_16bit_model(self._checkpoint_view(), save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model  # upstream's older name

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full module state dict on rank 0, None on other ranks (collective; at stage 3 it
        gathers the units whatever stage3_gather_16bit_weights_on_model_save says, as upstream)."""
        from .checkpoint.model_save import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self._checkpoint_view(), exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Upstream's stage-independent name (transformers uses it on its AutoTP path): without
        tensor parallelism it is the same full state dict on rank 0, None elsewhere (collective)."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def compile(self, backend: Any = "inductor", compile_kwargs: dict | None = None, **kwargs: Any) -> None:
        """torch.compile the wrapped module in place (upstream's `engine.compile`, which accelerate
        calls when dynamo is on). The engine's own hooks stay outside the compiled region.
        Further upstream options (`schedule`, compiled autograd) are accepted and ignored."""
        if self.is_compiled:
            return
        self.module.compile(**{**(compile_kwargs or {}), "backend": backend})
        self.__dict__["_is_compiled"] = True

    def destroy(self) -> None:
        """Remove the engine's hooks so the module can be reused or freed; waits for a background
        checkpoint save of this rank (and raises its error, if it failed here)."""
        try:
            if self._checkpoint_slot.current is not None:
                from .checkpoint.engine_io import wait_local

                wait_local(self._checkpoint_slot)
        finally:
            self._remove_hooks()
            self._obs.close()
            if getattr(self.optimizer, "swapper", None) is not None:   # NVMe offload: its swap files go
                self.optimizer.swapper.close()

    def _remove_hooks(self) -> None:
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        if self._stage3 is not None:  # parameters get their full values back
            self._stage3.remove()
            self._stage3 = None

    def __repr__(self) -> str:
        return f"DeepSpeedEngine(stage={self.zero_optimization_stage()}, dp_world_size={self.dp_world_size}, module={self.module!r})"
