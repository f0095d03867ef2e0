"""deepspeed.zero.GatheredParameters (read-only and modifier_rank, before and after initialize,
optimizer masters refreshed) and register_external_parameter (a module reading another
module's weight gathers it; before or after initialize), in Hugging Face's usage patterns."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepspeed
from deepspeed.runtime.zero.stage3 import ZeroParamStatus, plan_units
from harness import run_distributed
from models import TinyMLP, reference_training
from test_engine_dp import _config, train_engine
from test_zero3_engine import _assert_close_to, _z3


def _rank() -> int:
    return deepspeed.comm.get_rank() if deepspeed.comm.is_initialized() else 0


# --- external parameters ---------------------------------------------------------------------------
class TiedHead(nn.Module):
    """Reads `source.weight` (another module's parameter) without holding it."""

    def __init__(self, source: nn.Linear, register: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(source.in_features))
        self._source = [source]   # not a submodule: its parameters are not this module's
        if register:
            deepspeed.zero.register_external_parameter(self, source.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self._source[0].weight + self.bias


class ExternalLM(nn.Module):
    """The output layer, two levels down, reuses the input layer's weight (transposed)."""

    register = True

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 8)
        self.body = nn.Linear(8, 8)
        self.out = nn.Sequential(TiedHead(self.inp, self.register))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.out(torch.tanh(self.body(torch.tanh(self.inp(x)))))
        return logits if y is None else F.cross_entropy(logits, y)


class ExternalLMLate(ExternalLM):
    register = False


def test_plan_includes_external_parameters() -> None:
    model = ExternalLMLate()
    head = model.out[0]
    assert plan_units(model).module_units["out.0"] == (2,)
    deepspeed.zero.register_external_parameter(head, model.inp.weight)
    assert model.inp.weight.is_external_param   # upstream's flag, as its lifecycle tests read it
    plan = plan_units(model)
    assert [u.owner for u in plan.units] == ["inp", "body", "out.0"]   # ownership unchanged
    assert plan.module_units["out.0"] == (2, 0)
    deepspeed.zero.unregister_external_parameter(head, model.inp.weight)
    assert not model.inp.weight.is_external_param
    assert plan_units(model).module_units["out.0"] == (2,)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        deepspeed.zero.unregister_external_parameter(head, model.inp.weight)
    deepspeed.zero.register_external_parameter(head, nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        plan_units(model)
    with deepspeed.zero.Init():
        model = ExternalLMLate()
    with deepspeed.zero.GatheredParameters(model.inp.weight, fwd_module=model.out[0]):   # upstream: registers
        assert model.inp.weight.shape == (8, 16)
    assert plan_units(model).module_units["out.0"] == (2, 0)


def register_late(engine, step: int) -> None:
    if step == -1:
        head = engine.module.out[0]
        with pytest.raises(RuntimeError):   # unregistered, the shared weight is a released placeholder
            engine(torch.randn(2, 16))
        deepspeed.zero.register_external_parameter(head, engine.module.inp.weight)


def expect_found_automatically(engine, step: int) -> None:
    """Before the first step nothing is registered; after it the head's read was."""
    from deepspeed.runtime.zero.stage3.units import external_parameters

    found = [p is engine.module.inp.weight for p in external_parameters(engine.module.out[0])]
    assert found == ([] if step == -1 else [True]), (step, found)


def train_without_auto_external(*args):
    """train_engine with the automatic detection off (DEEPSPEED_ZERO3_AUTO_EXTERNAL=0)."""
    import os

    os.environ["DEEPSPEED_ZERO3_AUTO_EXTERNAL"] = "0"
    try:
        return train_engine(*args)
    finally:
        del os.environ["DEEPSPEED_ZERO3_AUTO_EXTERNAL"]


@pytest.mark.parametrize("when", ["before", "after", "automatic"])
def test_external_parameter_trains_like_plain_pytorch(when: str) -> None:
    """Registered before initialize, registered after a failing forward (automatic detection
    off), or found by the automatic detection ([Note: automatic external parameters])."""
    # units released after every forward (none kept for the backward): an unregistered external
    # read then certainly meets a released placeholder
    config = _config(micro=2, gas=2, zero_optimization=_z3(stage3_max_reuse_distance=0))
    run, cls, edit = {"before": (train_engine, ExternalLM, None),
                      "after": (train_without_auto_external, ExternalLMLate, register_late),
                      "automatic": (train_engine, ExternalLMLate, expect_found_automatically)}[when]
    results = run_distributed(2, run, config, 4, "engine", cls, edit)
    ref_losses, ref_state, _ = reference_training(config, 4, 2, model_cls=ExternalLM)
    _assert_close_to(results, ref_losses, ref_state)


class FunctionalTie(nn.Module):
    """The root reads `embed.weight` itself (a functional tied head), after metadata reads;
    `transposed`: through `.T` (a property read) instead of F.linear."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.body = nn.Linear(8, 8)
        self.transposed = transposed

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight
        assert weight.dtype == torch.float32 and weight.dim() in (1, 2)   # metadata: no gather
        assert self.body.weight.new_zeros(2).shape == (2,)                 # dtype/device only: no gather
        h = torch.tanh(self.body(self.embed(idx)))
        return h @ weight.T if self.transposed else F.linear(h, weight)


def automatic_external(steps: int, transposed: bool = False) -> dict:
    """Per step: all-gathers, and whether the root registered embed.weight; losses and
    gradients equal a replica's (the read is traced by autograd like any other use)."""
    import copy

    from deepspeed.runtime.zero.stage3 import Stage3Coordinator
    from deepspeed.runtime.zero.stage3.units import external_parameters

    rank, world = _rank(), deepspeed.comm.get_world_size()
    torch.manual_seed(0)
    model = FunctionalTie(transposed)
    ref = copy.deepcopy(model)
    coord = Stage3Coordinator(model, max_reuse_distance=0)   # released after each forward
    gathers, registered = [], []
    for step in range(steps):
        deepspeed.comm.comms_counter.reset()
        idx = [torch.randint(0, 12, (3, 5), generator=torch.Generator().manual_seed(10 * step + r))
               for r in range(world)]
        model(idx[rank]).square().mean().backward()
        for r in range(world):
            (ref(idx[r]).square().mean() / world).backward()
        gathers.append(deepspeed.comm.comms_counter.summary()["all_gather_into_tensor"]["count"])
        registered.append([p is model.embed.weight and p.is_external_param for p in external_parameters(model)])
        with torch.no_grad():
            torch.testing.assert_close(model(idx[rank]), ref(idx[rank]), rtol=1e-6, atol=1e-6)   # inference too
    grads = coord.full_state(grads=True)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-6, msg=name)
    return {"gathers": gathers, "registered": registered, "units": [u.spec.owner for u in coord.units]}


@pytest.mark.parametrize("transposed", [False, True])
def test_parameter_read_outside_its_module_is_found_automatically(transposed: bool) -> None:
    """[Note: automatic external parameters]: step 1 gathers embed's unit when the root reads it
    (forward: embed, body, the read; backward: body, root's read, embed) and registers it on the
    root; later steps gather it with the root's units -- no extra gather, the same count."""
    for r in run_distributed(2, automatic_external, 3, transposed):
        assert r["units"] == ["embed", "body"]
        assert r["registered"] == [[True]] * 3
        assert r["gathers"][1] == r["gathers"][2] <= r["gathers"][0], r


def unregistered_read_fails() -> str:
    import os

    from deepspeed.runtime.zero.stage3 import Stage3Coordinator

    os.environ["DEEPSPEED_ZERO3_AUTO_EXTERNAL"] = "0"
    try:
        model = FunctionalTie()
        Stage3Coordinator(model)
    finally:
        del os.environ["DEEPSPEED_ZERO3_AUTO_EXTERNAL"]
    with pytest.raises(RuntimeError) as failure:
        model(torch.zeros(2, 3, dtype=torch.long))
    return str(failure.value)


def test_automatic_detection_can_be_turned_off() -> None:
    assert all("size" in m or "shape" in m for m in run_distributed(2, unregistered_read_fails))


class WritesAndLeafReads(nn.Module):
    """`mode` "write": the root writes into a released parameter in place; "leaf": a z3 leaf
    reads another module's parameter that nobody registered."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.embed = nn.Linear(8, 8)
        self.leaf = TiedHead(self.embed, register=False)   # reads embed.weight in its forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "write":
            with torch.no_grad():
                self.leaf.bias.add_(1.0)       # released (the leaf's unit): the write would be lost
        return self.leaf(torch.tanh(self.embed(x)))


def refused(mode: str) -> str:
    from deepspeed.runtime.zero.stage3 import Stage3Coordinator
    from deepspeed.utils import set_z3_leaf_modules

    model = WritesAndLeafReads(mode)
    if mode == "leaf":
        set_z3_leaf_modules(model, [TiedHead])
    Stage3Coordinator(model, max_reuse_distance=0)
    with pytest.raises(RuntimeError) as failure:
        model(torch.ones(2, 8))
    return str(failure.value)


def test_in_place_writes_and_reads_inside_leaves_are_refused_by_name() -> None:
    for message in run_distributed(2, refused, "write"):
        assert "in-place write (add_)" in message and "modifier_rank" in message, message
    for message in run_distributed(2, refused, "leaf"):
        assert "leaf module 'leaf' read parameter 'embed.weight'" in message, message
        assert "register_external_parameter" in message, message


# --- GatheredParameters after initialize ------------------------------------------------------------
def set_fc1_after_step_1(model, step: int) -> None:
    """modifier_rank=0: rank 0's values win; the other ranks' writes are dropped."""
    if step != 1:
        return
    module = getattr(model, "module", model)
    with deepspeed.zero.GatheredParameters(module.fc1.weight, modifier_rank=0):
        with torch.no_grad():
            module.fc1.weight.fill_(0.01 if _rank() == 0 else 123.0)


def test_modifier_rank_after_initialize_updates_shards_and_masters() -> None:
    """Training goes on from the new values: the fp32 masters took them (else the next step
    would write the old weights back)."""
    config = _config(micro=1, gas=2, zero_optimization=_z3())
    results = run_distributed(2, train_engine, config, 4, "engine", TinyMLP, set_fc1_after_step_1)
    ref_losses, ref_state, _ = reference_training(config, 4, 2, edit=set_fc1_after_step_1)
    _assert_close_to(results, ref_losses, ref_state)


def read_after_initialize() -> dict:
    from models import make_model

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(zero_optimization=_z3()))
    weight = engine.module.fc1.weight
    with deepspeed.zero.GatheredParameters([weight, engine.module.fc1.weight, torch.ones(2)]):
        inside = (weight.detach().clone(), weight.ds_status)
        with torch.no_grad():
            weight.add_(1.0)                 # no modifier_rank: dropped
    with deepspeed.zero.GatheredParameters(weight):
        again = weight.detach().clone()
        alias = weight.detach()   # no copy: upstream's tests (and users) read it after the block
    return {"inside": inside, "again": again, "after": (weight.numel(), weight.ds_status), "alias": alias.clone()}


def test_read_full_weight_after_initialize() -> None:
    from models import make_model

    expected = make_model().fc1.weight.detach()
    for r in run_distributed(2, read_after_initialize):
        torch.testing.assert_close(r["inside"][0], expected, rtol=0, atol=0)
        torch.testing.assert_close(r["again"], expected, rtol=0, atol=0)
        torch.testing.assert_close(r["alias"], expected, rtol=0, atol=0)   # kept its values after the block
        assert r["inside"][1] is ZeroParamStatus.AVAILABLE
        assert r["after"] == (0, ZeroParamStatus.NOT_AVAILABLE)


# --- Hugging Face's patterns before initialize (zero.Init) ----------------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


def resize_and_init(model: TinyLM, new_vocab: int, rank: int, zero: bool = True) -> None:
    """resize_token_embeddings + _init_weights as transformers does them under ZeRO-3: rank 0
    writes (its own random draws), the others' writes are dropped."""
    old = model.embed
    with deepspeed.zero.Init(enabled=zero):
        new = nn.Embedding(new_vocab, old.embedding_dim)
    with deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        with torch.no_grad():
            n = old.weight.shape[0]
            new.weight[:n] = old.weight
            new.weight[n:] = 7.0 if rank == 0 else -1.0
    model.embed = new
    with deepspeed.zero.GatheredParameters(model.proj.weight, modifier_rank=0):
        if rank == 0:
            nn.init.normal_(model.proj.weight, generator=torch.Generator().manual_seed(3))


def hf_patterns() -> dict:
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = TinyLM()
    resize_and_init(model, 12, rank)
    sizes = [p.numel() for p in model.parameters()]
    with deepspeed.zero.GatheredParameters(model.embed.weight):
        embedding = model.embed.weight.detach().clone()
    torch.manual_seed(0)
    plain = TinyLM()
    resize_and_init(plain, 12, 0, zero=False)   # what rank 0 did, without ZeRO
    engine, *_ = deepspeed.initialize(model=model, config=_config(zero_optimization=_z3()))
    ids = torch.arange(12).view(3, 4)
    return {"sizes": sizes, "embedding": embedding, "plain_embedding": plain.embed.weight.detach(),
            "out": engine(ids).detach(), "plain_out": plain(ids).detach()}


def test_hugging_face_resize_and_init_under_zero_init() -> None:
    for r in run_distributed(2, hf_patterns):
        assert r["sizes"] == [0, 0, 0]        # still partitioned between the blocks
        assert r["embedding"].shape == (12, 6) and bool((r["embedding"][10:] == 7.0).all())
        torch.testing.assert_close(r["embedding"], r["plain_embedding"], rtol=0, atol=0)
        torch.testing.assert_close(r["out"], r["plain_out"], rtol=0, atol=0)
