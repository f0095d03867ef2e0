"""The collective counter: message bytes and ring wire bytes per op."""

import pytest

from deepspeed.comm.counting import CommsCounter


def test_counts_and_wire_bytes():
    c = CommsCounter()
    c.record("all_reduce", 100, 400, "torch.float32", 4, 0.01)
    c.record("all_reduce", 50, 200, "torch.float32", 4, 0.01)
    c.record("reduce_scatter_tensor", 100, 400, "torch.float32", 4, 0.0)
    s = c.summary()
    assert s["all_reduce"]["count"] == 2 and s["all_reduce"]["bytes"] == 600
    assert s["all_reduce"]["wire_bytes"] == pytest.approx(600 * 2 * 3 / 4)
    assert s["reduce_scatter_tensor"]["wire_bytes"] == pytest.approx(300)
    assert c.total("bytes") == 1000
    c.reset()
    assert c.summary() == {}


def test_disabled_counter_records_nothing():
    c = CommsCounter(enabled=False)
    c.record("all_reduce", 1, 4, "f", 2, 0.0)
    assert c.summary() == {}
