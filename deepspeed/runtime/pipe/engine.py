"""PipelineEngine: executes pipeline schedules on a PipelineModule's stage.

The engine is a DeepSpeedEngine whose module is one stage; `train_batch()` runs a TrainSchedule
(1F1B) over `gradient_accumulation_steps` micro-batches and `eval_batch()` an
InferenceSchedule. Everything numeric is the base engine's: the last stage's `backward(loss)`
(loss divided by the accumulation steps and loss-scaled), data-parallel reduction overlapped
with the last backward (ZeRO-1 and, unlike upstream, ZeRO-2: gradients reduce-scattered after
every micro-batch), the optimizer step. What the pipeline adds:

* gradients of tied weights summed over the stages that hold them (each tied weight has a
  gradient bucket of its own, so that at ZeRO-1/2 its gradient shard is laid out alike on
  every stage and the shards are summed directly);
* gradient norm and overflow agreed over the whole model (`OptimizerWrapper.split`), tied
  weights counted once;
* [Note: a failing stage] a stage that raises publishes the error in the rendezvous store
  and breaks its process groups; every other rank's pending communication then fails at once
  and raises PipelineError naming the failed stage, rank and instruction.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

import torch

from ... import comm as ds_comm
from ...comm.bounded import break_group
from ..activation_checkpointing import state as activation_checkpointing
from ..agreement import agree_config
from ..engine import DeepSpeedEngine
from ..errors import NotSupportedYet, UsageError
from ..optimizer_wrapper import OptimizerWrapper, SplitModel
from . import schedule
from .module import PipelineModule
from .p2p import StageLink

TRAIN_BATCH_TIMER = "train_batch"


class PipelineError(RuntimeError):
    """A pipeline stage failed; raised on every rank of the pipeline."""


class PipelineEngine(DeepSpeedEngine):
    """A training engine for hybrid pipeline and data parallelism (created by
    `deepspeed.initialize` when the model is a PipelineModule)."""

    ID_TO_DTYPE = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16,
                   torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
    DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}

    def __init__(self, has_bool_tensors: bool = False, *super_args: Any, **super_kwargs: Any) -> None:
        model = super_kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}")
        config_class = super_kwargs.get("config_class")
        if config_class is not None:   # before the config decides anything ([Note: cross-rank config agreement])
            agree_config(config_class, "PipelineEngine")
        if config_class is not None and config_class.model.zero_optimization.stage >= 3:
            raise NotSupportedYet("pipeline parallelism with zero_optimization.stage=3 is not supported (parameters "
                                  "would be gathered per stage by every micro-batch); use stage 1 or 2, which "
                                  "partition optimizer states and gradients across data-parallel replicas")
        if config_class is not None and not config_class.model.managed_gradient_accumulation:
            raise UsageError("managed_gradient_accumulation=false is not supported with pipeline parallelism: "
                             "train_batch() runs gradient_accumulation_steps micro-batches and steps itself")
        super().__init__(*super_args, **super_kwargs)
        self.pipeline_parallelism = True
        self.has_bool_tensors = has_bool_tensors
        self.grid = self.module.mpu()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.data_parallel_size > 1
        self.is_model_parallel = self.grid.model_parallel_size > 1
        self.data_iterator: Iterator | None = None
        self.batch_fn: Callable | None = None
        self.total_loss: torch.Tensor | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.eval_return_logits = False
        self.outputs: Any = None
        self._mode = "train"
        dynamic = bool(getattr(self.module, "dynamic_shape", False))
        self._to_prev = StageLink(self.grid.stage_to_global(self.prev_stage), self.device, dynamic) \
            if self.stage_id > 0 else None
        self._to_next = StageLink(self.grid.stage_to_global(self.next_stage), self.device, dynamic) \
            if self.stage_id < self.num_stages - 1 else None
        # the model group spans this replica's stages and tensor slices; a parameter replicated
        # over the tensor slices (a LayerNorm, the row bias) enters the norm on slice 0 only
        split = SplitModel(self.grid.get_model_parallel_group(), tensor_rank=self.grid.get_slice_parallel_rank()) \
            if self.grid.get_model_parallel_world_size() > 1 else None
        if isinstance(self.optimizer, OptimizerWrapper):
            self.optimizer.split = split
        self._split = split
        ids: list[Any] = [uuid.uuid4().hex if self.global_rank == 0 else None]
        if self.world_size > 1:
            ds_comm.broadcast_object_list(ids, src=0)
        self._failure_key = f"deepspeed/pipe/failure/{ids[0]}"
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            from ..dataloader import RepeatingLoader

            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        self._compute_loss = True
        self._apply_pipeline_config()
        self._buffers: dict[str, list[Any]] = {}

    def _apply_pipeline_config(self) -> None:
        """The `pipeline` section: `use_reentrant: false` selects non-reentrant checkpointing for the
        module (whatever the interval, so a later set_checkpoint_interval() honours it), and a
        positive `activation_checkpoint_interval` overrides the module's."""
        from ..activation_checkpointing import checkpointing

        section = self._config.model.pipeline
        if section.use_reentrant is False:
            self.module.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
        if section.activation_checkpoint_interval > 0:
            self.module.set_checkpoint_interval(section.activation_checkpoint_interval)

    def _solo_bucket_params(self) -> list[torch.nn.Parameter]:
        """Tied weights get gradient buckets of their own (see the module docstring)."""
        return [w for _, w, _ in self.module.tied_weights()]

    # --- the public surface ----------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Store an iterator to sample for training data."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """Train from `loader` (an iterable of batches); only the first and last stages read data."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn: Callable) -> None:
        """Run `fn` on every batch read from the data iterator."""
        self.batch_fn = fn

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the engine executes the last micro-batch's backward, a reduction or a step."""
        return bool(self._is_gradient_accumulation_boundary)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("forward() is disabled with pipeline parallelism: use train_batch() or eval_batch()")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("backward() is disabled with pipeline parallelism: use train_batch()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("step() is disabled with pipeline parallelism: use train_batch()")

    def set_train_batch_size(self, train_batch_size: int) -> None:
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def reset_activation_shape(self) -> None:
        """Exchange shapes again before the next transfer (after changing the micro-batch size)."""
        for link in (self._to_prev, self._to_next):
            if link is not None:
                link.sent.clear()
                link.received.clear()

    _progress_due: int | None = None

    def _report_progress(self, step: int, loss: float | None = None) -> None:
        """Printed by train_batch once the batch's loss is aggregated (rank 0 is the first stage,
        which sees no loss: the line showed loss=nan)."""
        self._progress_due = step

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Train on the next `gradient_accumulation_steps` micro-batches of `data_iter` (or the
        iterator set before) and step. Returns the batch's mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self._refuse_if_offloaded("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self._mode = "train"
        if self.wall_clock_breakdown():
            self.timers(TRAIN_BATCH_TIMER).start()
        self._execute(schedule.TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                             stage_id=self.stage_id))
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        if self._progress_due is not None:   # the step ran inside the schedule, before the loss was known
            super()._report_progress(self._progress_due, self.agg_train_loss.float().mean().item())
            self._progress_due = None
        if not self.is_last_stage():   # the last stage's own backward losses were recorded with the step
            self._obs.record_train_loss(self.agg_train_loss)
        if self.wall_clock_breakdown():
            self.timers(TRAIN_BATCH_TIMER).stop()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward `num_micro_batches` (default: gradient_accumulation_steps) micro-batches of
        `data_iter` without gradients. Returns the mean loss (broadcast to every stage when
        `bcast_loss`); with `return_logits`, also the last stage's outputs (None elsewhere)."""
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"eval_batch reduce_output={reduce_output!r}: use 'avg' or None")
        self._refuse_if_offloaded("eval_batch")
        self.eval_return_logits = return_logits
        self.module.eval()
        self._compute_loss = compute_loss
        saved, self.data_iterator = self.data_iterator, data_iter
        self._mode = "eval"
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.fwd_outputs: list[Any] = []
        self.outputs = [] if return_logits else None
        try:
            with torch.no_grad():
                self._execute(schedule.InferenceSchedule(micro_batches=micro_batches, stages=self.num_stages,
                                                         stage_id=self.stage_id))
        finally:
            self.data_iterator = saved
            self._mode = "train"
        result = None
        if self.is_last_stage():
            result = self._reduce_outputs(self.fwd_outputs, reduce_output, micro_batches)
        if compute_loss and bcast_loss:
            result = self._bcast_pipe_scalar(result)
        logits = self.outputs
        self.outputs, self.eval_return_logits = None, False
        return (result, logits) if return_logits else result

    # --- schedule execution ([Note: a failing stage]) ----------------------------------------
    def _execute(self, sched: schedule.PipeSchedule) -> None:
        self._buffers = {name: [None] * sched.num_pipe_buffers()
                         for name in ("inputs", "labels", "outputs", "losses", "grads")}
        self._backward_count = 0
        handlers = self._INSTRUCTION_MAP
        for step in sched:
            for cmd in step:
                handler = handlers.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r} "
                                       f"(from {type(sched).__name__})")
                try:
                    handler(self, **cmd.kwargs)
                except PipelineError:
                    raise
                except Exception as error:
                    self._fail(cmd, error)
        try:   # sends are asynchronous (p2p.StageLink): all of this schedule's must be done
            for link in (self._to_prev, self._to_next):
                if link is not None:
                    link.flush()
        except Exception as error:
            self._fail(cmd, error)
        self._buffers = {}

    def _fail(self, cmd: schedule.PipeInstruction, error: BaseException) -> None:
        store = torch.distributed.distributed_c10d._get_default_store() if self.world_size > 1 else None
        where = f"pipeline stage {self.stage_id} (rank {self.global_rank}) in {cmd!r}"
        peer = self._peer_failure(store, wait_s=5.0 if _is_comm_instruction(cmd) else 0.0)
        if peer is None:
            message = f"{where}: {type(error).__name__}: {error}"
            if store is not None:
                store.set(f"{self._failure_key}/{self.global_rank}", message)
                store.add(self._failure_key, 1)
            self._break_groups()
            raise PipelineError(f"{message}; every rank of the pipeline stops") from error
        self._break_groups()
        raise PipelineError(f"{where} stopped: {peer}") from error

    def _peer_failure(self, store: Any, wait_s: float) -> str | None:
        """The first published failure of another rank, waiting up to `wait_s` for one."""
        if store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            if store.add(self._failure_key, 0) > 0:
                for rank in range(self.world_size):
                    key = f"{self._failure_key}/{rank}"
                    if rank != self.global_rank and store.check([key]):
                        return store.get(key).decode()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _break_groups(self) -> None:
        groups = [None, self.grid.get_data_parallel_group(), self.grid.get_pipe_parallel_group(),
                  self.grid.get_model_parallel_group()] + [c["group"] for c in self.module.tied_comms.values()]
        for group in groups:
            try:
                break_group(group)
            except Exception:  # noqa: BLE001 - best effort: the group may be broken already
                pass

    # --- instructions -----------------------------------------------------------------------
    def _next_batch(self) -> Any:
        if self.data_iterator is None:
            raise ValueError("PipelineEngine: no data; pass data_iter to train_batch()/eval_batch() or "
                             "training_data to deepspeed.initialize")
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("pipeline data must yield (inputs, labels) pairs; got "
                             f"{type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}")
        return batch

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        inputs, labels = self._next_batch()
        if self.is_first_stage():
            grad_inputs = self._mode == "train" and self._reentrant_activation_checkpointing()

            def load(x: Any) -> torch.Tensor:
                if not torch.is_tensor(x):
                    raise TypeError(f"pipeline inputs must be tensors or tuples of tensors, got {type(x).__name__}")
                x = x.detach().to(self.device)
                x = self.precision.cast_input(x)
                return x.requires_grad_(x.is_floating_point()) if grad_inputs else x

            self._buffers["inputs"][buffer_id] = tuple(load(x) for x in inputs) \
                if isinstance(inputs, (tuple, list)) else load(inputs)
        if self.is_last_stage():
            moved = tuple(x.to(self.device) if torch.is_tensor(x) else x for x in labels) \
                if isinstance(labels, (tuple, list)) else (labels.to(self.device) if torch.is_tensor(labels) else labels)
            self._buffers["labels"][buffer_id] = moved

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints with a reentrant function, which needs the first stage's
        inputs to require grad (else the first checkpointed block is cut off from autograd)."""
        from ..activation_checkpointing import checkpointing

        return self.module.activation_checkpoint_interval > 0 and \
            self.module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint

    def _exec_forward_pass(self, buffer_id: int) -> None:
        inputs = self._buffers["inputs"][buffer_id]
        with self.precision.forward_context(self.device.type), \
                activation_checkpointing.activated(self._activation_checkpointing):
            outputs = self.module(inputs)
        if self.is_last_stage():
            labels = self._buffers["labels"][buffer_id]
            if self._mode == "eval" and self.outputs is not None:
                self.outputs.append(outputs)
            loss_fn = self.module.loss_fn
            if self._mode == "eval" and (not self._compute_loss or loss_fn is None):
                self.fwd_outputs.append(outputs)   # no loss: the outputs themselves (upstream)
            else:
                loss = loss_fn(outputs, labels) if loss_fn is not None else outputs
                if not torch.is_tensor(loss) or loss.numel() != 1:
                    raise ValueError("the last pipeline stage must produce a scalar loss (give PipelineModule a "
                                     f"loss_fn); got {type(loss).__name__} "
                                     f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
                self._buffers["losses"][buffer_id] = loss
                detached = loss.detach().float()
                self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
                if self._mode == "eval":
                    self.fwd_outputs.append(detached)
        else:
            self._buffers["outputs"][buffer_id] = outputs

    def _exec_backward_pass(self, buffer_id: int) -> None:
        self._backward_count += 1
        self._is_gradient_accumulation_boundary = self._backward_count == self.micro_batches
        if self.is_last_stage():
            loss = self._buffers["losses"][buffer_id]
            self._buffers["losses"][buffer_id] = None
            DeepSpeedEngine.backward(self, loss)
        else:
            outputs = self._buffers["outputs"][buffer_id]
            grads = self._buffers["grads"][buffer_id]
            tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
                       if torch.is_tensor(t) and t.requires_grad and t.is_floating_point()]
            if self._bstate.begin():
                self._backward_prologue()
            self._bstate.engine_driven = True
            try:
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors=grads)
            finally:
                self._bstate.engine_driven = False
            self._backward_epilogue()
            self._buffers["outputs"][buffer_id] = None
            self._buffers["grads"][buffer_id] = None
        if self.is_first_stage():
            self._buffers["inputs"][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int) -> None:
        self._to_next.send_activation(self._buffers["outputs"][buffer_id], self._mode)
        if self._mode == "eval":
            self._buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id: int) -> None:
        self._buffers["inputs"][buffer_id] = self._to_prev.recv_activation(self._mode)

    def _exec_send_grads(self, buffer_id: int) -> None:
        self._to_prev.send_grads(self._buffers["inputs"][buffer_id], self._mode)
        self._buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        self._buffers["grads"][buffer_id] = self._to_next.recv_grads(self._mode)

    def _exec_reduce_tied_grads(self) -> None:
        """Sum tied weights' (already data-parallel averaged) gradients over their stages."""
        self._is_gradient_accumulation_boundary = True
        self.allreduce_gradients()   # a no-op when the last backward reduced (the usual case)
        for _, weight, comm in self.module.tied_weights():
            ds_comm.all_reduce(self._tied_grad(weight), group=comm["group"])

    def _tied_grad(self, weight: torch.nn.Parameter) -> torch.Tensor:
        reducer = self._reducer
        if reducer is not None and reducer.owns(weight):
            return reducer.reduced_grad(weight)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        return weight.grad

    def _exec_reduce_grads(self) -> None:
        self._is_gradient_accumulation_boundary = True
        self.allreduce_gradients()

    def _exec_optimizer_step(self, lr_kwargs: dict | None = None) -> None:
        self._is_gradient_accumulation_boundary = True
        self._take_model_step(lr_kwargs)
        self.micro_steps += self.micro_batches
        self._is_gradient_accumulation_boundary = None

    _INSTRUCTION_MAP = {
        schedule.OptimizerStep: _exec_optimizer_step,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
    }

    # --- losses -------------------------------------------------------------------------------
    def _aggregate_total_loss(self) -> torch.Tensor:
        """Mean loss over micro-batches and data-parallel replicas, on every stage."""
        if self.is_last_stage():
            total = self.total_loss if self.total_loss is not None else torch.zeros((), device=self.device)
            loss = total / self.micro_batches
            loss = loss.reshape(1).to(self.device)
            if self.is_data_parallel:
                ds_comm.all_reduce(loss, group=self.grid.get_data_parallel_group())
                loss /= self.grid.data_parallel_size
        else:
            loss = None
        return self._bcast_pipe_scalar(loss)[0]

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
        if reduce is None:
            return outputs
        if not outputs:
            return None
        if torch.is_tensor(outputs[0]):
            reduced = sum(o.float() for o in outputs) / micro_batches
            if self.is_data_parallel:
                reduced = reduced.reshape(-1).clone()
                ds_comm.all_reduce(reduced, group=self.grid.get_data_parallel_group())
                reduced = (reduced / self.grid.data_parallel_size).reshape(outputs[0].shape)
            return reduced
        reduced = [sum(o[i].float() for o in outputs) / micro_batches for i in range(len(outputs[0]))]
        if self.is_data_parallel:
            for value in reduced:
                ds_comm.all_reduce(value, group=self.grid.get_data_parallel_group())
                value /= self.grid.data_parallel_size
        return reduced

    def _bcast_pipe_scalar(self, data: Any, src_rank: int | None = None, dtype: torch.dtype = torch.float32) -> Any:
        src = self.grid.stage_to_global(self.num_stages - 1) if src_rank is None else src_rank
        if self.global_rank == src:
            result = data.detach().reshape(-1)[:1].to(device=self.device, dtype=dtype).clone()
        else:
            result = torch.zeros(1, dtype=dtype, device=self.device)
        if self.num_stages > 1:
            ds_comm.broadcast(result, src=src, group=self.grid.get_pipe_parallel_group())
        return result

    # --- state ([Note: repartitioning at load] in checkpoint.py) -----------------------------------
    def _extra_checkpoint_files(self, exclude_frozen_parameters: bool = False) -> list[tuple[str, dict]]:
        from .checkpoint import layer_files

        return layer_files(self.module)

    def _checkpoint_reader(self, view: Any, load_dir: str, tag: str) -> Any:
        """The view's `reader_factory` ([Note: checkpoint view]): this stage's reader."""
        from .checkpoint import checkpoint_reader

        return checkpoint_reader(view, load_dir, tag)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> None:
        """Pipeline models are saved per layer (`save_checkpoint` writes the layer files);
        the model-states file carries no module weights, as upstream."""
        return None

    def load_module_state_dict(self, checkpoint: Any, strict: bool = True, custom_load_fn: Any = None,
                               fetch_z3_params: bool = False) -> None:
        """Load this stage's layers from a checkpoint directory (the `checkpoint` argument is
        the directory, or a dict with a `module` state dict of this stage)."""
        if isinstance(checkpoint, dict) and checkpoint.get("module") is not None:
            self.module.load_state_dict(checkpoint["module"], strict=strict)
            return
        if isinstance(checkpoint, str):
            self.module.load_state_dir(checkpoint, strict=strict)
            return
        raise ValueError("load_module_state_dict expects a checkpoint directory or a dict with 'module'")

    def __repr__(self) -> str:
        return (f"PipelineEngine(stage={self.stage_id}/{self.num_stages}, zero_stage={self.zero_optimization_stage()}, "
                f"dp_world_size={self.dp_world_size}, module={type(self.module).__name__})")


def _is_comm_instruction(cmd: schedule.PipeInstruction) -> bool:
    return isinstance(cmd, (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad,
                            schedule.ReduceGrads, schedule.ReduceTiedGrads, schedule.OptimizerStep))
