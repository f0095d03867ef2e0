"""deepspeed.checkpointing in one process: RNG replay, argument and output shapes, settings,
errors, the tracker, per-owner isolation. Ranks and engines:
tests/distributed/test_activation_checkpointing_ranks.py.

Gradients are compared bit for bit (rtol=0, atol=0) between a checkpointed and a plain run:
the recompute runs the same kernels on the same tensors in the same order as the plain forward
(the replayed RNG states make dropout draw the same masks), and the backward then runs the same
kernels on the same values. See [Note: bit equality in tests] in tests/README.md.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.runtime.activation_checkpointing import state
from deepspeed.runtime.activation_checkpointing.stash import ContiguousBuffer, InputStash

ckpt = deepspeed.checkpointing
FNS = {"reentrant": ckpt.checkpoint, "non_reentrant": ckpt.non_reentrant_checkpoint}


@pytest.fixture(autouse=True)
def _process_owner():
    """Each test starts from an unconfigured process-wide owner and leaves it so."""
    owner = state.PROCESS
    saved = (owner.settings, owner.mpu, owner.configured, owner.buffer, owner.stats)
    owner.settings, owner.mpu, owner.configured, owner.buffer = state.CheckpointingSettings(), None, False, None
    owner.stats = state.CheckpointStats()
    yield owner
    owner.settings, owner.mpu, owner.configured, owner.buffer, owner.stats = saved


class Block(nn.Module):
    """Dropout from the default generator and from the tracker's model-parallel state."""

    def __init__(self, dim: int = 16, tracker: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.3)
        self.tracker = tracker

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = torch.nn.functional.gelu(self.fc1(h))
        if self.tracker:
            with ckpt.get_cuda_rng_tracker().fork():
                a = self.drop(a)
        return h + self.fc2(self.drop(a))


def _train(blocks: nn.ModuleList, x: torch.Tensor, fn=None, autocast: bool = False) -> list[torch.Tensor]:
    for p in blocks.parameters():
        p.grad = None
    h = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = h
        for b in blocks:
            out = fn(b, out) if fn is not None else b(out)
    out.float().square().mean().backward()
    return [out.detach(), h.grad] + [p.grad for p in blocks.parameters()] + [torch.rand(3)]  # RNG left as plain


@pytest.mark.parametrize("tracker", [False, True], ids=["default-rng", "tracker-rng"])
@pytest.mark.parametrize("kind", list(FNS))
def test_dropout_gradients_bit_equal(kind: str, tracker: bool) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(tracker=tracker) for _ in range(3))
    x = torch.randn(4, 16)
    ckpt.model_parallel_cuda_manual_seed(1234)
    ref = _train(blocks, x)
    ckpt.model_parallel_cuda_manual_seed(1234)
    got = _train(blocks, x, FNS[kind])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(FNS))
def test_autocast_replayed_in_recompute(kind: str) -> None:
    """Backward runs outside the user's autocast; the recompute must re-enter it (bf16 here)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(2))
    x = torch.randn(4, 16)
    for r, g in zip(_train(blocks, x, autocast=True), _train(blocks, x, FNS[kind], autocast=True)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def _mixed(a, flag, b=None, *, scale=1.0, extra=None):
    out = a * scale + (b if b is not None else 0)
    return out, flag, None, (a > 0), {"sum": (out * 2).sum(), "tag": "t"}


@pytest.mark.parametrize("kind", list(FNS))
def test_mixed_arguments_and_outputs(kind: str) -> None:
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    out = FNS[kind](_mixed, a, 3, b, scale=torch.tensor(2.0, requires_grad=True), extra="x")
    plain = _mixed(a, 3, b, scale=2.0)
    assert out[1] == 3 and out[2] is None and out[4]["tag"] == "t"
    assert out[3].dtype == torch.bool and not out[3].requires_grad
    torch.testing.assert_close(out[0], plain[0])
    (out[0].sum() + out[4]["sum"]).backward()
    torch.testing.assert_close(a.grad, torch.full((5,), 6.0))
    torch.testing.assert_close(b.grad, torch.full((5,), 3.0))


@pytest.mark.parametrize("kind", list(FNS))
def test_none_and_non_grad_inputs(kind: str) -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = FNS[kind](lambda t, none, mask: lin(t) * mask, x, None, torch.ones(4))
    out.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_non_reentrant_without_input_grad_and_with_autograd_grad() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)                         # no input requires grad: parameters still get grads
    ckpt.non_reentrant_checkpoint(lin, x).sum().backward()
    assert lin.weight.grad is not None
    y = torch.randn(2, 4, requires_grad=True)
    (g,) = torch.autograd.grad(ckpt.non_reentrant_checkpoint(lin, y).sum(), [y])
    torch.testing.assert_close(g, lin.weight.sum(0).expand(2, 4))
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):
        torch.autograd.grad(ckpt.checkpoint(lin, y).sum(), [y])


def test_no_grad_runs_plainly(_process_owner) -> None:
    with torch.no_grad():
        out = ckpt.checkpoint(nn.Linear(3, 3), torch.randn(2, 3))
    assert out.grad_fn is None and _process_owner.stats.forwards == 0


# --- configuration ---------------------------------------------------------------------------
def test_config_then_explicit_arguments(tmp_path) -> None:
    section = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 4,
               "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "profile": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 1, "activation_checkpointing": section}))
    for cfg in ({"activation_checkpointing": section}, str(path),
                deepspeed.DeepSpeedConfig(str(path), world_size=1)):
        ckpt.configure(None, deepspeed_config=cfg, num_checkpoints=8, profile=False, synchronize=None)
        s = ckpt.settings()
        assert (s.partition_activations, s.contiguous_checkpointing, s.num_checkpoints, s.checkpoint_in_cpu,
                s.synchronize, s.profile) == (True, True, 8, True, True, False)
    assert ckpt.is_configured() and ckpt.PARTITION_ACTIVATIONS and ckpt.num_layers == 8


def test_unconfigured_defaults() -> None:
    assert not ckpt.is_configured() and ckpt.settings() == state.CheckpointingSettings()
    assert ckpt.checkpoint(lambda t: t * 2, torch.ones(2, requires_grad=True)).sum().item() == 4.0


@pytest.mark.parametrize("kwargs,match", [
    ({"partition_activations": False, "contiguous_checkpointing": True, "num_checkpoints": 2},
     r"contiguous_memory_optimization\) requires partition_activations"),
    ({"partition_activations": True, "contiguous_checkpointing": True}, r"requires num_checkpoints \(activation_"
                                                                       r"checkpointing.number_checkpoints\)"),
    ({"num_checkpoints": 0}, "must be a positive integer"),
])
def test_bad_combinations(kwargs: dict, match: str) -> None:
    ckpt.configure(None, profile=True)
    for error in (ValueError, AssertionError):   # upstream asserts: both catch it
        with pytest.raises(error, match=match):
            ckpt.configure(None, **kwargs)
    assert ckpt.settings().profile and not ckpt.settings().contiguous_checkpointing   # nothing changed


def test_profile_logs_and_synchronize_counts(_process_owner, caplog) -> None:
    ckpt.configure(None, profile=True, synchronize=True)
    lin = nn.Linear(3, 3)
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        caplog.handler.setLevel(logging.INFO)
        logging.getLogger("DeepSpeed").addHandler(caplog.handler)
        try:
            ckpt.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum().backward()
        finally:
            logging.getLogger("DeepSpeed").removeHandler(caplog.handler)
    text = caplog.text
    assert "forward of Linear took" in text and "recompute of Linear took" in text
    stats = _process_owner.stats
    assert (stats.forwards, stats.recomputes, stats.synchronizations) == (1, 1, 4)


# --- RNG tracker ------------------------------------------------------------------------------
def test_tracker_add_fork_states() -> None:
    # The tracker forks the accelerator's generator (CUDA's where one is visible), so draw there.
    accel = deepspeed.accelerator.get_accelerator()
    dev = accel.device_name()
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("a", 11)
    with pytest.raises(ValueError, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 12)
    before = accel.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3, device=dev)
    assert torch.equal(accel.get_rng_state(), before)   # the caller's stream is untouched
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(3, device=dev)
    assert not torch.equal(first, second)                # a fork continues where the last one ended
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3, device=dev), second)
    accel.manual_seed(11)
    assert torch.equal(torch.rand(3, device=dev), first)
    tracker.reset()
    assert tracker.get_states() == {}
    with pytest.raises(KeyError, match="not added"):
        with tracker.fork("a"):
            pass


class _Mpu:
    """A model-parallel unit as Megatron's: plain answers, no process group needed for seeding."""

    def __init__(self, mp_rank: int) -> None:
        self.mp_rank = mp_rank

    def get_model_parallel_rank(self) -> int:
        return self.mp_rank


def test_model_parallel_seed_rule() -> None:
    dev = deepspeed.accelerator.get_accelerator().device_name()   # the generator the tracker forks
    ckpt.configure(_Mpu(1))
    ckpt.model_parallel_cuda_manual_seed(5)
    default_draw = torch.rand(2, device=dev)
    with ckpt.get_cuda_rng_tracker().fork():
        mp_draw = torch.rand(2, device=dev)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2, device=dev), default_draw)
    torch.manual_seed(5 + 2718 + 1)
    assert torch.equal(torch.rand(2, device=dev), mp_draw)


# --- owners ------------------------------------------------------------------------------------
def test_owners_do_not_interfere(_process_owner) -> None:
    """A region records the owner it ran under; its recompute counts there, whatever is current."""
    a, b = state.ActivationCheckpointing(), state.ActivationCheckpointing()
    a.configure(None, state.CheckpointingSettings(profile=True))
    lin, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    with state.activated(a):
        assert ckpt.settings().profile
        out_a = ckpt.checkpoint(lin, x)
    with state.activated(b):
        assert not ckpt.settings().profile
        out_b = ckpt.non_reentrant_checkpoint(lin, x)
        out_a.sum().backward()
    out_b.sum().backward()
    assert (a.stats.forwards, a.stats.recomputes, b.stats.forwards, b.stats.recomputes) == (1, 1, 1, 1)
    assert _process_owner.stats.forwards == 0 and not ckpt.settings().profile


def test_contiguous_buffer_slots() -> None:
    buf = ContiguousBuffer(2)
    v1 = buf.take([torch.ones(3), torch.full((2,), 2.0)], torch.device("cpu"))
    v2 = buf.take([torch.ones(3), torch.ones(2)], torch.device("cpu"))
    assert all(v.untyped_storage().data_ptr() == buf.flat.untyped_storage().data_ptr() for v in v1 + v2)
    assert buf.flat.tolist() == [1, 1, 1, 2, 2, 1, 1, 1, 1, 1]
    with pytest.raises(RuntimeError, match="num_checkpoints=2"):
        buf.take([torch.ones(3), torch.ones(2)], torch.device("cpu"))
    buf.give_back(), buf.give_back()
    assert buf.next_slot == 0
    with pytest.raises(ValueError, match="homogeneous"):
        buf.take([torch.ones(4)], torch.device("cpu"))
    buf.reset()


def test_import_is_lazy_and_aliases() -> None:
    code = ("import sys, deepspeed; assert 'deepspeed.runtime.activation_checkpointing' not in sys.modules; "
            "import deepspeed.checkpointing as c; "
            "import deepspeed.runtime.activation_checkpointing.checkpointing as r; "
            "assert c is r is deepspeed.checkpointing; "
            "from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint, "
            "CheckpointFunction, CudaRNGStatesTracker, get_cuda_rng_tracker, reset")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", list(FNS))
def test_retain_graph_second_backward(kind: str) -> None:
    lin, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    out = FNS[kind](lin, x).sum()
    out.backward(retain_graph=True)
    first = lin.weight.grad.clone()
    out.backward()
    torch.testing.assert_close(lin.weight.grad, 2 * first, rtol=0, atol=0)   # g + g is exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA RNG replay and CPU-kept inputs")
@pytest.mark.parametrize("kind", list(FNS))
def test_cuda_dropout_bit_equal_and_inputs_kept_on_cpu(kind: str, _process_owner) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(tracker=True) for _ in range(2)).cuda()
    x = torch.randn(4, 16, device="cuda")
    ckpt.model_parallel_cuda_manual_seed(99)
    ref = _train(blocks, x)
    ckpt.configure(None, checkpoint_in_cpu=True)
    ckpt.model_parallel_cuda_manual_seed(99)
    got = _train(blocks, x, FNS[kind])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert _process_owner.stats.kept_nbytes == _process_owner.stats.input_nbytes > 0
    stash = InputStash([x], _process_owner.stash_plan())
    assert stash.kept[0].data.device.type == "cpu" and stash.restore()[0].device.type == "cuda"
