"""Pure plans of the data-parallel engine: accumulation boundaries, bucket plans, reduce scaling."""

import pytest

from deepspeed.runtime.grad_accum import is_boundary
from deepspeed.runtime.grad_reducer import ReducePolicy, plan_buckets


@pytest.mark.parametrize("gas", [1, 2, 4])
def test_boundary_every_gas_micro_steps(gas):
    flags = [is_boundary(m, gas) for m in range(3 * gas)]
    assert flags == ([False] * (gas - 1) + [True]) * 3


def test_boundary_override_wins():
    assert is_boundary(0, 4, True) is True
    assert is_boundary(3, 4, False) is False


def test_buckets_respect_cap_and_order():
    assert plan_buckets([4, 4, 4, 4], bucket_numel=8) == [[0, 1], [2, 3]]
    assert plan_buckets([10, 1, 1], bucket_numel=4) == [[0], [1, 2]]  # oversize tensor alone
    assert plan_buckets([1, 1, 1, 1, 1], bucket_numel=3, first_bucket_numel=1) == [[0], [1, 2, 3], [4]]
    assert plan_buckets([], bucket_numel=3) == []
    flat = [i for b in plan_buckets([3, 5, 2, 7, 1], 6) for i in b]
    assert flat == [0, 1, 2, 3, 4]  # every parameter exactly once, order kept


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("prescale,predivide", [(False, 1.0), (False, 2.0), (False, 8.0), (True, 1.0)])
def test_reduce_policy_always_averages(world, prescale, predivide):
    policy = ReducePolicy(world, prescale, predivide)
    # sum over `world` identical contributions of 1.0 must come back as 1.0
    assert policy.before() * world * policy.after() == pytest.approx(1.0)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("prescale,predivide", [(False, 1.0), (False, 2.0), (False, 8.0), (True, 1.0)])
def test_reduce_policy_sum_op_sums(world, prescale, predivide):
    policy = ReducePolicy(world, prescale, predivide, op="sum")
    # gradient_allreduce_op "sum": `world` contributions of 1.0 come back as `world`
    assert policy.before() * world * policy.after() == pytest.approx(world)
