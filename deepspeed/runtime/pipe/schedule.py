"""Pipeline schedules: pure generators of instruction lists, one list per step.

A schedule knows nothing about tensors or processes: `TrainSchedule(micro_batches=4, stages=2,
stage_id=0)` yields, step by step, what stage 0 does (`LoadMicroBatch(buffer_id=0)`,
`ForwardPass(buffer_id=0)`, `SendActivation(buffer_id=0)`, ...); the PipelineEngine executes
them. Users subclass these classes, so the streams equal DeepSpeed 0.19.8's (tested against
fixtures of its output in tests/fixtures/pipe_schedules.json).

[Note: the 1F1B clock]
TrainSchedule runs 2·(m + p - 1) steps for m micro-batches on p stages. On step t, stage s works
on a forward when t - s is even (micro-batch (t - s)/2) and on a backward when it is odd
(micro-batch (t - 2p + 1 + s)/2): micro-batch i's forward reaches stage s at 2i + s, its
backward leaves stage s at 2i + 2p - 1 - s. A step whose micro-batch is out of range does
nothing of its own. The send belonging to a step's pass happens on the next step, paired with
the neighbour's receive on that same step; even and odd stages order their send and receive
oppositely, so blocking point-to-point operations always find their partner. Stage s holds
at most p - s micro-batches in flight, so it needs max(2, min(p - s, m)) buffers.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..utils import call_to_str


class PipeInstruction:
    """One action of the pipeline engine; keyword arguments become attributes (like a namedtuple)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after ReduceGrads and ReduceTiedGrads)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients among data-parallel replicas of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied modules among the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction that works on one of the stage's pipeline buffers."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into a buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Compute this stage's forward on the buffer's inputs."""


class BackwardPass(BufferOpInstruction):
    """Compute this stage's backward for the buffer (last stage: from the loss)."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs into the buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's outputs from the next stage."""


class PipeSchedule:
    """Base of the schedules: a generator of instruction lists for one stage.

    Each yielded list is atomic: a barrier between successive steps cannot deadlock.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: need micro_batches >= 1, stages >= 1 and "
                             f"0 <= stage_id < stages; got micro_batches={micro_batches}, stages={stages}, "
                             f"stage_id={stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator | None = None

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError(f"{type(self).__name__} must implement steps()")

    def num_pipe_buffers(self) -> int:
        """Buffers the engine allocates for this stage (by default one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is outside 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> "PipeSchedule":
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only: micro-batch i is on stage s at step i + s."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = self.micro_batches + self.stages - 1
        for step in range(total):
            current = step - self.stage_id
            previous = current - 1
            cmds: list[PipeInstruction] = []
            has_current = self._valid_micro_batch(current)
            has_previous = self._valid_micro_batch(previous) and not self.is_last_stage
            if has_current and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(current % 2))
            receive = [RecvActivation(current % 2)] if has_current and not self.is_first_stage else []
            send = [SendActivation(previous % 2)] if has_previous else []
            cmds += receive + send if self.stage_id % 2 else send + receive  # see [Note: the 1F1B clock]
            if has_current:
                cmds.append(ForwardPass(current % 2))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two buffers: one being received into while the other is sent."""
        return 2


class TrainSchedule(PipeSchedule):
    """1F1B training: after a warm-up, each stage alternates one forward and one backward, so
    activations of at most p - s micro-batches are alive. See [Note: the 1F1B clock]."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        previous, previous_forward = -1, False
        for step in range(total):
            current, forward = self._micro_batch_at(step)
            cmds: list[PipeInstruction] = []
            has_current = self._valid_micro_batch(current)
            has_previous = self._valid_micro_batch(previous)
            if forward:
                if has_previous and not previous_forward and not self.is_first_stage:
                    cmds.append(SendGrad(self._buffer_idx(previous)))
                if has_current and not self.is_first_stage:
                    cmds.append(RecvActivation(self._buffer_idx(current)))
            else:
                if has_current and not self.is_last_stage:
                    cmds.append(RecvGrad(self._buffer_idx(current)))
                if has_previous and previous_forward and not self.is_last_stage:
                    cmds.append(SendActivation(self._buffer_idx(previous)))
            if has_current:
                buffer = self._buffer_idx(current)
                if forward:
                    if self.is_first_stage or self.is_last_stage:
                        cmds.append(LoadMicroBatch(buffer))
                    cmds.append(ForwardPass(buffer))
                else:
                    cmds.append(BackwardPass(buffer))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous, previous_forward = current, forward
            yield cmds

    def _micro_batch_at(self, step: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of `step` on this stage; the micro-batch may be out of range."""
        if (step - self.stage_id) % 2 == 0:
            return (step - self.stage_id) // 2, True
        return (step - 2 * self.stages + 1 + self.stage_id) // 2, False

    def num_pipe_buffers(self) -> int:
        """As many buffers as micro-batches in flight on this stage: its distance to the end."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism with gradient accumulation (one stage's view): load, forward,
    backward per micro-batch, then reduce and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for micro_batch in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if micro_batch == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """One buffer: each micro-batch is finished before the next is loaded."""
        return 1
