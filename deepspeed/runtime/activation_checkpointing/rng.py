"""Random-number state for activation checkpointing: the model-parallel tracker and snapshots.

A checkpointed region runs its forward twice (once in forward, once in the recompute during
backward). Dropout must draw the same numbers both times or the gradients are wrong, so a
`RngSnapshot` taken before the first run is installed around the recompute and the generators are
put back afterwards. It covers the CPU generator, the accelerator's generator (CUDA when that is
the accelerator) and every named state of the `CudaRNGStatesTracker`.

[Note: device generator]
The tracker's states are states of the *accelerator's* generator: CUDA's on a GPU and the CPU
default generator on a CPU-only machine (DeepSpeed's CPU accelerator does the same), so Megatron-
style `get_cuda_rng_tracker().fork()` code runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ...accelerator import get_accelerator as _accelerator

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718   # Megatron's offset between the data-parallel and model-parallel seeds


class CudaRNGStatesTracker:
    """Named generator states, each seeded once, swapped in by `fork(name)`.

    `add(name, seed)` creates a state without disturbing the current one; `fork(name)` runs a
    block on that state and keeps where the block left it, so successive forks draw fresh
    numbers. The states are those of the accelerator's generator (see [Note: device generator]).
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the tensors are the tracker's; they are never mutated)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (seeds stay recorded, as upstream)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create state `name` from `seed`; each name and each seed may be used once."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        self.seeds_.add(seed)
        accel = _accelerator()
        current = accel.get_rng_state()
        accel.manual_seed(seed)
        self.states_[name] = accel.get_rng_state()
        accel.set_rng_state(current)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on state `name`, then store where it ended and restore the caller's."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added "
                           f"(call model_parallel_cuda_manual_seed(seed) or tracker.add({name!r}, seed) first)")
        accel = _accelerator()
        outside = accel.get_rng_state()
        accel.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accel.get_rng_state()
            accel.set_rng_state(outside)


def model_parallel_seeds(seed: int, mpu: Any) -> tuple[int, int]:
    """(data-parallel seed, model-parallel seed) for this rank, Megatron's rule: the model-parallel
    seed differs per model-parallel rank and is the same across data-parallel replicas."""
    mp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    return seed, seed + _SEED_OFFSET + mp_rank


def seed_model_parallel(tracker: CudaRNGStatesTracker, seed: int, mpu: Any) -> None:
    """Seed the device generator with the data-parallel seed and the tracker's
    'model-parallel-rng' state with the model-parallel one."""
    dp_seed, mp_seed = model_parallel_seeds(seed, mpu)
    _accelerator().manual_seed(dp_seed)
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG, mp_seed)


@dataclass
class RngSnapshot:
    """Every generator state a checkpointed forward may draw from, taken before it runs."""

    cpu: torch.Tensor
    device: Optional[torch.Tensor]
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, tracker: CudaRNGStatesTracker) -> "RngSnapshot":
        # CUDA's state whenever CUDA is in use (whatever the accelerator: saving it is harmless)
        device = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), device, tracker.get_states())

    def install(self, tracker: CudaRNGStatesTracker) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device)
        tracker.set_states(self.tracker)

    @contextlib.contextmanager
    def replayed(self, tracker: CudaRNGStatesTracker) -> Iterator[None]:
        """Run the block with the snapshot's states, then put back the states found on entry,
        so the recompute neither sees nor leaves a trace in the generators."""
        found = RngSnapshot.capture(tracker)
        self.install(tracker)
        try:
            yield
        finally:
            found.install(tracker)
