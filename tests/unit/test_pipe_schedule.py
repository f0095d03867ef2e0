"""Pipeline schedules and topologies: pure, checked against DeepSpeed 0.19.8's output
(tests/fixtures/pipe_*.json, made by tools/fixtures/gen_pipe_schedules.py) and by a simulator
that runs every stage's stream with blocking point-to-point semantics."""

import json
import os

import pytest

from deepspeed.runtime.pipe import schedule as sched
from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             ProcessTopology, default_topology)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


SCHEDULES = _load("pipe_schedules.json")["schedules"]


def _encode(cmds):
    return [[type(c).__name__, dict(sorted(c.kwargs.items()))] for c in cmds]


@pytest.mark.parametrize("kind", ["TrainSchedule", "InferenceSchedule", "DataParallelSchedule"])
def test_streams_equal_upstream(kind):
    cases = [c for c in SCHEDULES if c["kind"] == kind]
    assert len(cases) == 8 * (1 + 2 + 3 + 4)
    for case in cases:
        s = getattr(sched, kind)(micro_batches=case["micro_batches"], stages=case["stages"],
                                 stage_id=case["stage_id"])
        where = f"{kind}(micro_batches={case['micro_batches']}, stages={case['stages']}, stage_id={case['stage_id']})"
        assert s.num_pipe_buffers() == case["num_pipe_buffers"], where
        assert [_encode(step) for step in s.steps()] == case["steps"], where
        assert [_encode(step) for step in s] == case["steps"], where   # iterating the schedule itself


def _simulate(kind, micro_batches, stages):
    """Run all stages' streams with rendezvous (blocking) sends and receives. Returns the
    forward/backward order per stage; fails on deadlock or on a receive of the wrong micro-batch."""
    programs, buffers, pcs = [], [], []
    for s in range(stages):
        schedule = getattr(sched, kind)(micro_batches=micro_batches, stages=stages, stage_id=s)
        programs.append([c for step in schedule.steps() for c in step])
        buffers.append({})
        pcs.append(0)
    loaded = [0] * stages
    done = [[] for _ in range(stages)]
    pending = {}   # (channel) -> payload, set by a send waiting for its receive

    def partner(s, cmd):
        if isinstance(cmd, sched.SendActivation):
            return ("act", s, s + 1)
        if isinstance(cmd, sched.RecvActivation):
            return ("act", s - 1, s)
        if isinstance(cmd, sched.SendGrad):
            return ("grad", s, s - 1)
        if isinstance(cmd, sched.RecvGrad):
            return ("grad", s + 1, s)
        return None

    while any(pcs[s] < len(programs[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pcs[s] < len(programs[s]):
                cmd = programs[s][pcs[s]]
                channel = partner(s, cmd)
                if isinstance(cmd, (sched.SendActivation, sched.SendGrad)):
                    if channel in pending:
                        break   # previous send on this channel not yet received
                    key = "fwd" if isinstance(cmd, sched.SendActivation) else "bwd"
                    pending[channel] = buffers[s][cmd.buffer_id][key]
                    pcs[s] += 1
                    progressed = True
                    break   # blocking: wait until received before going on
                if isinstance(cmd, (sched.RecvActivation, sched.RecvGrad)):
                    if channel not in pending:
                        break
                    mb = pending.pop(channel)
                    if isinstance(cmd, sched.RecvActivation):
                        entry = buffers[s].get(cmd.buffer_id, {})
                        labels = {"label": entry["label"]} if "label" in entry and "mb" not in entry else {}
                        buffers[s][cmd.buffer_id] = {"mb": mb, **labels}
                    else:
                        assert buffers[s][cmd.buffer_id]["fwd"] == mb, "gradient for another micro-batch"
                        buffers[s][cmd.buffer_id]["grad_in"] = mb
                elif isinstance(cmd, sched.LoadMicroBatch):
                    if s == 0:
                        buffers[s][cmd.buffer_id] = {"mb": loaded[s]}
                    else:   # last stage: labels, loaded before or after the activation arrives
                        entry = buffers[s].get(cmd.buffer_id, {})
                        if "mb" in entry and "fwd" not in entry:
                            entry["label"] = loaded[s]
                        else:
                            buffers[s][cmd.buffer_id] = {"label": loaded[s]}
                    loaded[s] += 1
                elif isinstance(cmd, sched.ForwardPass):
                    entry = buffers[s][cmd.buffer_id]
                    assert entry.get("label", entry["mb"]) == entry["mb"], "labels for another micro-batch"
                    buffers[s][cmd.buffer_id]["fwd"] = buffers[s][cmd.buffer_id]["mb"]
                    done[s].append(("F", buffers[s][cmd.buffer_id]["mb"]))
                elif isinstance(cmd, sched.BackwardPass):
                    entry = buffers[s][cmd.buffer_id]
                    if s != stages - 1:
                        assert entry.get("grad_in") == entry["fwd"], "backward before its gradient arrived"
                    entry["bwd"] = entry["fwd"]
                    done[s].append(("B", entry["fwd"]))
                pcs[s] += 1
                progressed = True
        # a pending send whose receiver consumed it lets the sender go on; otherwise stuck
        if not progressed:
            raise AssertionError(f"{kind} deadlocks for micro_batches={micro_batches}, stages={stages}: "
                                 f"stages stopped at {[programs[s][pcs[s]] if pcs[s] < len(programs[s]) else 'end' for s in range(stages)]}")
    assert not pending, f"unreceived sends: {pending}"
    return done


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 8, 9])
def test_train_schedule_runs_without_deadlock(stages, micro_batches):
    done = _simulate("TrainSchedule", micro_batches, stages)
    for s, order in enumerate(done):
        assert [mb for kind, mb in order if kind == "F"] == list(range(micro_batches))
        assert [mb for kind, mb in order if kind == "B"] == list(range(micro_batches))
        # in flight on stage s: never more than its buffers
        alive, peak = 0, 0
        for kind, _ in order:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak <= sched.TrainSchedule(micro_batches, stages, s).num_pipe_buffers()


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 3, 8])
def test_inference_schedule_runs_without_deadlock(stages, micro_batches):
    done = _simulate("InferenceSchedule", micro_batches, stages)
    assert all([mb for _, mb in order] == list(range(micro_batches)) for order in done)


def test_simulator_detects_a_deadlock():
    class Swapped(sched.TrainSchedule):   # every stage receives before it sends: classic deadlock
        def steps(self):
            for cmds in super().steps():
                recvs = [c for c in cmds if isinstance(c, (sched.RecvActivation, sched.RecvGrad))]
                yield recvs + [c for c in cmds if c not in recvs]

    sched.SwappedForTest = Swapped
    try:
        with pytest.raises(AssertionError, match="deadlocks"):
            _simulate("SwappedForTest", 4, 3)
    finally:
        del sched.SwappedForTest


def test_schedule_surface():
    s = sched.TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    assert (s.stage, s.num_stages, s.num_micro_batches, s.is_first_stage, s.is_last_stage) == (1, 3, 4, False, False)
    assert repr(sched.ForwardPass(buffer_id=2)) == "ForwardPass(buffer_id=2)"
    assert sched.ForwardPass(2).buffer_id == 2 and sched.OptimizerStep().kwargs == {}
    with pytest.raises(ValueError, match="stage_id"):
        sched.TrainSchedule(micro_batches=2, stages=2, stage_id=2)
    with pytest.raises(NotImplementedError):
        list(sched.PipeSchedule(1, 1, 0).steps())


TOPO = _load("pipe_topology.json")


@pytest.mark.parametrize("case", TOPO["cases"], ids=lambda c: f"{c['axes']}{c['dims']}")
def test_topology_equals_upstream(case):
    t = ProcessTopology(axes=case["axes"], dims=case["dims"])
    assert t.world_size() == case["world_size"]
    assert [list(t.get_coord(r)) for r in range(t.world_size())] == case["coords"]
    for r, coord in enumerate(case["coords"]):
        assert t.get_rank(**dict(zip(case["axes"], coord))) == r
    for axis, lists in case["axis_comm_lists"].items():
        assert t.get_axis_comm_lists(axis) == lists, axis
    for key, ranks in case["axis_lists"].items():
        axis, idx = key.split("=")
        assert t.get_axis_list(axis, int(idx)) == ranks
    for key, text in case["repr"].items():
        if key.endswith("/omit-none"):
            assert t.get_rank_repr(int(key.split("/")[0]), omit_axes=[]) == text
        else:
            assert t.get_rank_repr(int(key)) == text
    for kwargs, ranks in case["filter"]:
        assert t.filter_match(**kwargs) == ranks


def test_named_topologies_and_default():
    pd = PipeDataParallelTopology(num_pp=2, num_dp=3)
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    for topo, name in ((pd, "PipeDataParallelTopology(2,3)"), (pmd, "PipeModelDataParallelTopology(2,2,2)")):
        want = TOPO["named"][name]
        assert topo.get_axis_names() == want["axes"]
        assert [list(topo.get_coord(r)) for r in range(topo.world_size())] == want["coords"]
    assert (default_topology(12).get_dim("pipe"), default_topology(12).get_dim("data")) == (6, 2)
    assert (default_topology(4).get_dim("pipe"), default_topology(4).get_dim("data")) == (2, 2)
    assert (default_topology(1).get_dim("pipe"), default_topology(1).get_dim("data")) == (1, 1)
    assert pd.get_dim("model") == 0
    with pytest.raises(ValueError, match="outside"):
        pd.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="same length"):
        ProcessTopology(axes=["a"], dims=[1, 2])
