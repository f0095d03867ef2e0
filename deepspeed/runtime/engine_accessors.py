"""Legacy engine accessors (`engine.fp16_enabled()`, `engine.zero_optimization_stage()`, ...).

Downstream code (Hugging Face, Accelerate, Lightning, Megatron) calls these names; the runtime
itself reads the typed config. Each accessor is one row of a table instead of one method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .checkpoint.view import CheckpointView, PendingSlot

# accessor name -> function of the DeepSpeedConfig
_ACCESSORS: dict[str, Callable[[Any], Any]] = {
    "train_batch_size": lambda c: c.train_batch_size,
    "train_micro_batch_size_per_gpu": lambda c: c.train_micro_batch_size_per_gpu,
    "gradient_accumulation_steps": lambda c: c.gradient_accumulation_steps,
    "gradient_clipping": lambda c: c.gradient_clipping,   # DeepSpeedConfig attribute, as upstream reads it
    "log_level": lambda c: c.log_level,
    "steps_per_print": lambda c: c.model.steps_per_print,
    "wall_clock_breakdown": lambda c: c.model.wall_clock_breakdown,
    "memory_breakdown": lambda c: c.model.memory_breakdown,
    "dump_state": lambda c: c.model.dump_state,
    "fp16_enabled": lambda c: c.model.fp16.enabled,
    "bfloat16_enabled": lambda c: c.model.bf16.enabled,
    "fp16_auto_cast": lambda c: c.model.fp16.auto_cast,
    "amp_enabled": lambda c: False,
    "torch_autocast_enabled": lambda c: c.model.torch_autocast.enabled,
    "dynamic_loss_scale": lambda c: c.model.fp16.enabled and c.model.fp16.loss_scale == 0,
    "loss_scale": lambda c: c.model.fp16.loss_scale,
    "initial_dynamic_scale": lambda c: 2 ** c.model.fp16.initial_scale_power,
    "postscale_gradients": lambda c: not c.model.prescale_gradients,
    "gradient_predivide_factor": lambda c: c.model.gradient_predivide_factor,
    "zero_optimization": lambda c: c.model.zero_optimization.stage > 0,
    "zero_optimization_stage": lambda c: c.model.zero_optimization.stage,
    "zero_optimization_partition_gradients": lambda c: c.model.zero_optimization.stage >= 2,
    "zero_optimization_partition_weights": lambda c: c.model.zero_optimization.stage >= 3,
    "zero_reduce_bucket_size": lambda c: c.model.zero_optimization.reduce_bucket_size,
    "zero_allgather_bucket_size": lambda c: c.model.zero_optimization.allgather_bucket_size,
    "zero_overlap_comm": lambda c: c.model.zero_optimization.overlap_comm,
    "managed_gradient_accumulation": lambda c: c.model.managed_gradient_accumulation,
    "zero_contiguous_gradients": lambda c: c.model.zero_optimization.contiguous_gradients,
    "zero_allow_untested_optimizer": lambda c: c.model.zero_allow_untested_optimizer,
    "zero_force_ds_cpu_optimizer": lambda c: c.model.zero_force_ds_cpu_optimizer,
    "zero_ignore_unused_parameters": lambda c: c.model.zero_optimization.ignore_unused_parameters,
    "zero_offload_optimizer": lambda c: _offload_device(c.model.zero_optimization.offload_optimizer),
    "zero_offload_param": lambda c: _offload_device(c.model.zero_optimization.offload_param),
    "zero_cpu_offload": lambda c: _offload_device(c.model.zero_optimization.offload_optimizer) in ("cpu", "nvme"),
    "zero_hpz_partition_size": lambda c: c.model.zero_optimization.zero_hpz_partition_size,
    "zero_quantized_weights": lambda c: c.model.zero_optimization.zero_quantized_weights,
    "zero_quantized_nontrainable_weights": lambda c: c.model.zero_optimization.zero_quantized_nontrainable_weights,
    "zero_quantized_gradients": lambda c: c.model.zero_optimization.zero_quantized_gradients,
    "zero_gather_16bit_weights_on_model_save":
        lambda c: c.model.zero_optimization.stage3_gather_16bit_weights_on_model_save,
    "optimizer_name": lambda c: c.model.optimizer.name if c.model.optimizer else None,
    "optimizer_params": lambda c: dict(c.model.optimizer.params) if c.model.optimizer else None,
    "scheduler_name": lambda c: c.model.scheduler.type if c.model.scheduler else None,
    "scheduler_params": lambda c: dict(c.model.scheduler.params) if c.model.scheduler else None,
    "dataloader_drop_last": lambda c: c.model.dataloader_drop_last,
    "sparse_gradients_enabled": lambda c: bool(getattr(c.model, "sparse_gradients", False)),
    "checkpoint_tag_validation_enabled": lambda c: _tag_validation(c) != "ignore",
    "checkpoint_tag_validation_fail": lambda c: _tag_validation(c) == "fail",
    "elasticity_enabled": lambda c: c.elasticity_enabled,
}


def _offload_device(section: Any) -> Any:
    device = getattr(section, "device", None) if section is not None else None
    value = getattr(device, "value", device)
    return None if value in (None, "none") else value


def _tag_validation(config: Any) -> str:
    value = getattr(config.model.checkpoint, "tag_validation", "WARN")
    return str(getattr(value, "value", value)).lower()


def _make(name: str, getter: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def accessor(self: Any) -> Any:
        return getter(self._config)

    accessor.__name__ = name
    accessor.__doc__ = f"Config value `{name}` (legacy accessor)."
    return accessor


class EngineAccessors:
    """Mixin: one method per row of `_ACCESSORS`, reading `self._config`; and the checkpoint file
    names upstream's engine exposes (tests and Megatron-style trainers call them)."""

    @property
    def _checkpoint_slot(self) -> PendingSlot:
        """The background save in flight ([Note: checkpoint view]): one slot per engine, made on first use."""
        from .checkpoint.view import PendingSlot

        return self.__dict__.setdefault("_pending_slot", PendingSlot())

    def _checkpoint_view(self) -> CheckpointView:
        """What the checkpoint code reads and writes of this engine, now ([Note: checkpoint view] in
        runtime/checkpoint/view.py): built at each checkpoint entry point, the only place that reads the
        engine for it."""
        from .. import comm as ds_comm
        from .checkpoint.view import CheckpointView, Counters, file_mp_rank

        def set_counters(counters: Counters) -> None:
            self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
            self.skipped_steps = counters.skipped_steps

        section, pipeline = self._config.model.checkpoint, bool(self.pipeline_parallelism)
        mpu, split = getattr(self, "mpu", None), getattr(self, "_split", None)
        return CheckpointView(
            module=self.module, optimizer=self.optimizer, has_optimizer=self._has_optimizer,
            lr_scheduler=self.lr_scheduler, stage3=self._stage3, global_rank=self.global_rank,
            dp_group=self.seq_data_parallel_group, dp_rank=ds_comm.get_rank(self.seq_data_parallel_group),
            dp_world_size=self.seq_dp_world_size, mp_rank=file_mp_rank(mpu, split),
            mp_world_size=getattr(self, "mp_world_size", 1), mpu=mpu, split=split,
            expert_comm=getattr(self, "_expert_comm", None) or {}, moe_layers=list(self.moe_layers),
            num_experts=list(self.num_experts), grid=getattr(self, "grid", None), pipeline=pipeline,
            num_stages=self.num_stages if pipeline else 1, stage_id=self.stage_id if pipeline else 0,
            zero_stage=self.zero_optimization_stage(), bf16=bool(self.bfloat16_enabled()),
            mixed_precision=self.precision.is_mixed, gradient_clipping=float(self.gradient_clipping()),
            train_batch_size=int(self.train_batch_size()),
            gather_16bit_weights=bool(self.zero_gather_16bit_weights_on_model_save()), ds_config=self.config,
            tag_validation=str(section.tag_validation), async_save=bool(section.async_save),
            load_universal=bool(section.load_universal),
            counters=Counters(self.global_steps, self.global_samples, self.skipped_steps), set_counters=set_counters,
            pending=self._checkpoint_slot, extra_files=getattr(self, "_extra_checkpoint_files", None),
            reader_factory=getattr(self, "_checkpoint_reader", None))

    def _load_hp_state(self, checkpoint_dir: str) -> None:
        """The optimizer facade's `load_hp_checkpoint_state_from_checkpoint_dir` (base_optimizer.py)."""
        from .checkpoint.loader import load_hp_state

        load_hp_state(self._checkpoint_view(), checkpoint_dir)

    @staticmethod
    def _validate_autoep_folding_checkpoint_metadata(state: Any, **kwargs: Any) -> None:
        """Upstream's check of a loaded file's EP x TP folding record (checkpoint/folding.py)."""
        from .checkpoint.folding import validate_checkpoint_folding

        validate_checkpoint_folding(state, **kwargs)

    @staticmethod
    def _get_expert_ckpt_name(checkpoints_path: str, layer_id: int, expert_id: int, tag: Any, mpu: Any = None,
                              checkpoint_mp_rank: int | None = None) -> str:
        """Upstream's static: one expert's file (checkpoint/moe_state_dict.py)."""
        from .checkpoint.moe_state_dict import expert_ckpt_name

        return expert_ckpt_name(checkpoints_path, layer_id, expert_id, tag, mpu, checkpoint_mp_rank)

    @staticmethod
    def load_moe_state_dict(checkpoint_path: str, tag: Any, state_dict: dict, old_moe_load: bool, model: Any = None,
                            mpu: Any = None, num_experts: Any = 1, checkpoint_engine: Any = None,
                            **kwargs: Any) -> None:
        """Upstream's static: this rank's experts of `model` into `state_dict` (checkpoint/moe_state_dict.py;
        Megatron-DeepSpeed calls it)."""
        from .checkpoint.moe_state_dict import load_moe_state_dict

        load_moe_state_dict(checkpoint_path, tag, state_dict, old_moe_load, model, mpu, num_experts,
                            checkpoint_engine, **kwargs)

    def get_sequence_parallel_group(self) -> Any:
        """The ranks sharing one sample's sequence (None without sequence parallelism): upstream's accessor."""
        return self.seq_parallel_group

    def autotp_size(self) -> int:
        """The AutoTP tensor-parallel size the engine runs (1 without AutoTP), even where the plan left every
        layer whole: upstream's accessor."""
        from ..module_inject.layers import tensor_parallel_size

        return getattr(self, "_autotp_size", None) or tensor_parallel_size(self.module)

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_is_compiled", False)

    @property
    def checkpoint_mp_rank(self) -> int:
        from .checkpoint.view import file_mp_rank

        return file_mp_rank(getattr(self, "mpu", None), getattr(self, "_split", None))

    def _get_ckpt_name(self, checkpoints_path: str, tag: Any, mp_placeholder: str | None = None,
                       pp_placeholder: Any = None) -> str:
        """This rank's model-states file under `checkpoints_path/tag`."""
        import os

        mp = mp_placeholder if mp_placeholder is not None else f"{self.checkpoint_mp_rank:02d}"
        if self.zero_optimization_partition_weights():
            dp = pp_placeholder if pp_placeholder is not None else self._checkpoint_view().dp_rank
            return os.path.join(checkpoints_path, str(tag), f"zero_pp_rank_{dp}_mp_rank_{mp}_model_states.pt")
        return os.path.join(checkpoints_path, str(tag), f"mp_rank_{mp}_model_states.pt")

    def _get_zero_param_shapes(self) -> list:
        """Upstream's: per optimizer param group, {parameter name: full shape} of the trained
        parameters in the order the checkpoint files flatten them (their `param_shapes`)."""
        from collections import OrderedDict

        from .checkpoint.hp_state import HpState

        if not self._has_optimizer:
            raise ValueError("_get_zero_param_shapes: the engine has no optimizer (its shapes are per param group)")
        return [OrderedDict(group) for group in HpState(self).groups]

    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: Any) -> str:
        """This rank's optimizer-partition file under `checkpoints_path/tag`."""
        import os

        from ..checkpoint.files import optim_file

        dp = self._checkpoint_view().dp_rank
        return os.path.join(checkpoints_path, str(tag),
                            optim_file(dp, bool(self.bfloat16_enabled()), self.checkpoint_mp_rank))

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any, expp_rank: int) -> str:
        """Upstream's expert-parallel optimizer file name (MoE; this build writes none)."""
        import os

        return os.path.join(checkpoints_path, str(tag),
                            f"expp_rank_{expp_rank}_mp_rank_{self.checkpoint_mp_rank:02d}_optim_states.pt")

    @staticmethod
    def _change_recovery_script_permissions(dst: str) -> None:
        """Upstream's: make the zero_to_fp32.py beside the tags executable; where the file system refuses
        (Azure Files) or the file is gone, log it and go on (the save writes it through the same rule)."""
        import os
        import stat

        from ..checkpoint.files import set_mode

        mode = os.stat(dst).st_mode if os.path.exists(dst) else 0o755
        set_mode(dst, mode | stat.S_IEXEC, dst)


for _name, _getter in _ACCESSORS.items():
    setattr(EngineAccessors, _name, _make(_name, _getter))
