"""The test harness itself: a worker process that dies (as gloo's abort kills one on a size
mismatch) fails that call with a named error, and the next call gets a fresh pool."""

from __future__ import annotations

import os

import pytest

from harness import DistributedTestError, run_distributed


def die_on_last_rank() -> int:
    import deepspeed.comm as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(3)
    return dist.get_rank()


def rank_of() -> int:
    import deepspeed.comm as dist

    return dist.get_rank()


def test_a_dead_worker_fails_the_call_and_the_pool_is_rebuilt() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1's process died \(exit code 3"):
        run_distributed(2, die_on_last_rank)
    assert run_distributed(2, rank_of) == [0, 1]
