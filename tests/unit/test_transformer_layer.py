"""DeepSpeedTransformerLayer: parity with Hugging Face's BertLayer (Post-LN) and a plain-PyTorch
Pre-LN reference (outputs and every gradient), dtypes, masks, dropout reproducibility, and the
memory flags (fewer saved bytes, same values). ZeRO-3: tests/distributed/test_transformer_layer_zero3.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import deepspeed
from deepspeed.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

H, I, HEADS, B, S = 64, 256, 4, 3, 20          # S not a multiple of 16: upstream's kernel padded there
EPS = 1e-12
FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")
UPSTREAM_NAMES = ["attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b",
                  "output_w", "output_b", "norm_w", "norm_b"]


def make_config(**kw) -> DeepSpeedTransformerConfig:
    base = {"batch_size": B, "hidden_size": H, "intermediate_size": I, "heads": HEADS, "attn_dropout_ratio": 0.0,
            "hidden_dropout_ratio": 0.0, "num_hidden_layers": 4, "initializer_range": 0.02, "layer_norm_eps": EPS,
            "pre_layer_norm": False}
    base.update(kw)
    return DeepSpeedTransformerConfig(**base)


def hf_layer(seed: int = 0):
    from transformers.models.bert.modeling_bert import BertConfig, BertLayer

    cfg = BertConfig(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS, layer_norm_eps=EPS,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = BertLayer(cfg)
    with torch.no_grad():       # non-trivial LayerNorms and biases, so every parameter matters
        for name, p in layer.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return layer


def hf_tensors(layer):
    sa, ao, out = layer.attention.self, layer.attention.output, layer.output
    mods = (sa.query, sa.key, sa.value, ao.dense, ao.LayerNorm, layer.intermediate.dense, out.dense, out.LayerNorm)
    return [m.weight for m in mods], [m.bias for m in mods]


def hf_grads(layer) -> dict[str, torch.Tensor]:
    """The HF layer's gradients under our parameter names."""
    (w, b) = hf_tensors(layer)
    grads = {"attn_qkvw": torch.cat([t.grad for t in w[:3]]), "attn_qkvb": torch.cat([t.grad for t in b[:3]])}
    for i, prefix in ((3, "attn_o"), (4, "attn_n"), (5, "inter_"), (6, "output_"), (7, "norm_")):
        grads[prefix + "w"], grads[prefix + "b"] = w[i].grad, b[i].grad
    return grads


def padding_mask(dtype=torch.float32, batch=B) -> torch.Tensor:
    """HF BERT's extended mask [B,1,1,S]: 0 to attend, dtype's min for padding (rows 1.. padded)."""
    mask = torch.zeros(batch, 1, 1, S, dtype=dtype)
    for row in range(1, batch):
        mask[row, ..., S - 3 * row:] = torch.finfo(dtype).min
    return mask


def run(module, x, mask, grad):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, mask)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), x.grad


def assert_rel(actual, expected, rel, name=""):
    """Elementwise within rel of the tensor's scale (near-zero entries of sums cancel)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale, msg=lambda m: f"{name}: {m}")


def inputs(seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g).to(dtype), torch.randn(B, S, H, generator=g).to(dtype)


# ---------------------------------------------------------------- surface and config

def test_public_names_and_paths():
    from deepspeed.ops.transformer import transformer as mod

    assert deepspeed.DeepSpeedTransformerLayer is DeepSpeedTransformerLayer is mod.DeepSpeedTransformerLayer
    assert deepspeed.DeepSpeedTransformerConfig is DeepSpeedTransformerConfig is mod.DeepSpeedTransformerConfig
    from deepspeed.ops.op_builder import TransformerBuilder

    assert deepspeed.ops.__compatible_ops__[TransformerBuilder.NAME]      # upstream's tests gate on this


def test_config_defaults_aliases_and_files(tmp_path):
    cfg = DeepSpeedTransformerConfig(hidden_size=32, heads=4)
    assert cfg.intermediate_size == 128 and cfg.pre_layer_norm and cfg.adjust_init_range and cfg.training
    assert cfg.layer_norm_eps == 1e-12 and cfg.seed == -1 and cfg.local_rank == -1 and not cfg.return_tuple
    assert DeepSpeedTransformerConfig(huggingface=True).return_tuple
    cfg.huggingface = True
    assert cfg.return_tuple and cfg.to_dict()["huggingface"]
    for encoding in ("utf-16", "utf-8"):   # upstream reads UTF-16
        path = tmp_path / f"{encoding}.json"
        path.write_text(json.dumps({"hidden_size": 48, "heads": 6, "bf16": True}), encoding=encoding)
        loaded = DeepSpeedTransformerConfig.from_json_file(str(path))
        assert (loaded.hidden_size, loaded.heads, loaded.intermediate_size, loaded.bf16) == (48, 6, 192, True)


def test_layer_id_counter_names_and_shapes():
    first = DeepSpeedTransformerLayer(make_config())
    second = DeepSpeedTransformerLayer(make_config())
    assert second.config.layer_id == first.config.layer_id + 1 == DeepSpeedTransformerLayer.layer_id - 1
    assert list(first.state_dict()) == UPSTREAM_NAMES
    shapes = {n: tuple(p.shape) for n, p in first.named_parameters()}
    assert shapes["attn_qkvw"] == (3 * H, H) and shapes["inter_w"] == (I, H) and shapes["output_w"] == (H, I)
    second.load_state_dict(first.state_dict())           # upstream's layout in, same layout out
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


def test_init_and_adjust_init_range():
    torch.manual_seed(0)
    big = {"hidden_size": 512, "intermediate_size": 1024, "heads": 8, "num_hidden_layers": 8, "initializer_range": 0.02}
    adjusted = DeepSpeedTransformerLayer(make_config(**big))
    plain = DeepSpeedTransformerLayer(make_config(adjust_init_range=False, **big))
    assert abs(adjusted.attn_qkvw.std().item() - 0.02) < 1e-3
    assert abs(adjusted.attn_ow.std().item() - 0.02 / 4) < 2e-4 and abs(adjusted.output_w.std().item() - 0.005) < 2e-4
    assert abs(plain.attn_ow.std().item() - 0.02) < 1e-3
    assert torch.equal(adjusted.norm_w, torch.ones(512)) and not adjusted.attn_qkvb.any()


def test_config_and_call_errors():
    with pytest.raises(ValueError, match="hidden_size"):
        DeepSpeedTransformerLayer(DeepSpeedTransformerConfig(heads=4))
    with pytest.raises(ValueError, match="multiple"):
        DeepSpeedTransformerLayer(make_config(heads=5))
    layer = DeepSpeedTransformerLayer(make_config())
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.zeros(1, 4, H, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="head_mask"):
        layer(torch.zeros(1, 4, H), head_mask=torch.ones(HEADS))
    with pytest.raises(ValueError, match="8 tensors"):
        DeepSpeedTransformerLayer(make_config(), initial_weights=[torch.zeros(H, H)])


# ---------------------------------------------------------------- numerical parity

@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_post_ln_matches_hf_bert_layer(masked):
    ref = hf_layer()
    ours = DeepSpeedTransformerLayer(make_config(return_tuple=True), *hf_tensors(ref))
    x, grad = inputs()
    mask = padding_mask() if masked else None
    ref_out, ref_dx = run(ref, x, mask, grad)
    out, dx = run(ours, x, mask, grad)
    assert_rel(out, ref_out, 1e-5, "output")
    assert_rel(dx, ref_dx, 1e-5, "input grad")
    ref_grads = hf_grads(ref)
    for name, p in ours.named_parameters():
        assert_rel(p.grad, ref_grads[name], 1e-5, name)


def preln_reference(layer: DeepSpeedTransformerLayer, x, mask):
    """Pre-LN BERT layer written out in plain PyTorch on the layer's own parameters."""
    p = dict(layer.named_parameters())
    h = F.layer_norm(x, (H,), p["attn_nw"], p["attn_nb"], EPS)
    q, k, v = (t.view(B, S, HEADS, H // HEADS).transpose(1, 2)
               for t in F.linear(h, p["attn_qkvw"], p["attn_qkvb"]).chunk(3, dim=-1))
    scores = q @ k.transpose(-1, -2) / (H // HEADS) ** 0.5 + (0 if mask is None else mask)
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, H)
    a = x + F.linear(ctx, p["attn_ow"], p["attn_ob"])
    f = F.layer_norm(a, (H,), p["norm_w"], p["norm_b"], EPS)
    return a + F.linear(F.gelu(F.linear(f, p["inter_w"], p["inter_b"])), p["output_w"], p["output_b"])


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_pre_ln_matches_plain_pytorch(masked):
    ours = DeepSpeedTransformerLayer(make_config(pre_layer_norm=True), *hf_tensors(hf_layer()))
    x, grad = inputs()
    mask = padding_mask() if masked else None
    out, dx = run(ours, x, mask, grad)
    ours_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ref_out, ref_dx = run(lambda x_, m: preln_reference(ours, x_, m), x, mask, grad)
    assert_rel(out, ref_out, 1e-5, "output")
    assert_rel(dx, ref_dx, 1e-5, "input grad")
    for name, p in ours.named_parameters():
        assert_rel(ours_grads[name], p.grad, 1e-5, name)


@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-ln", "pre-ln"])
def test_bf16_close_to_fp32(pre_ln):
    """bf16 (parameters and activations) against the same layer in fp32: bf16's 8-bit mantissa."""
    ref = DeepSpeedTransformerLayer(make_config(pre_layer_norm=pre_ln), *hf_tensors(hf_layer()))
    low = DeepSpeedTransformerLayer(make_config(pre_layer_norm=pre_ln, bf16=True), *hf_tensors(hf_layer()))
    low.bfloat16()
    x, grad = inputs()
    ref_out, ref_dx = run(ref, x, padding_mask(), grad)
    out, dx = run(low, x.bfloat16(), padding_mask(torch.bfloat16), grad.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_rel(out.float(), ref_out, 4e-2, "output")
    assert_rel(dx.float(), ref_dx, 4e-2, "input grad")
    for (name, p), q in zip(low.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16
        assert_rel(p.grad.float(), q.grad, 4e-2, name)


def test_fp16_and_autocast_run():
    layer = DeepSpeedTransformerLayer(make_config(fp16=True, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1))
    x, grad = inputs()
    out, dx = run(layer.half(), x.half(), padding_mask(torch.float16), grad.half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and torch.isfinite(dx).all()
    fp32 = DeepSpeedTransformerLayer(make_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp32(x, padding_mask())
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and fp32.attn_qkvw.grad.dtype == torch.float32


def test_boolean_mask_equals_additive_mask():
    layer = DeepSpeedTransformerLayer(make_config(), *hf_tensors(hf_layer()))
    x, grad = inputs()
    additive = padding_mask()
    assert torch.equal(run(layer, x, additive, grad)[0], run(layer, x, additive == 0, grad)[0])


# ---------------------------------------------------------------- dropout

def dropout_layer(**kw):
    return DeepSpeedTransformerLayer(make_config(attn_dropout_ratio=0.2, hidden_dropout_ratio=0.2, **kw),
                                     *hf_tensors(hf_layer()))


def seeded_run(layer, seed, mask=None):
    x, grad = inputs()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out, dx = run(layer, x, padding_mask() if mask is None else mask, grad)
    return out, dx, [p.grad.clone() for p in layer.parameters()]


def test_dropout_reproducible_with_fixed_seed():
    layer = dropout_layer()
    first, again, other = seeded_run(layer, 7), seeded_run(layer, 7), seeded_run(layer, 8)
    assert all(torch.equal(a, b) for a, b in zip(first[:2] + tuple(first[2]), again[:2] + tuple(again[2])))
    assert not torch.equal(first[0], other[0])
    layer.eval()          # no dropout in eval: equals the layer built without dropout
    no_dropout = DeepSpeedTransformerLayer(make_config(), *hf_tensors(hf_layer()))
    assert torch.equal(layer(inputs()[0]), no_dropout(inputs()[0]))


def test_config_seed_is_mixed_into_masks():
    a, b = seeded_run(dropout_layer(seed=1), 7)[0], seeded_run(dropout_layer(seed=2), 7)[0]
    assert not torch.equal(a, b)


def test_stochastic_mode():
    layer = dropout_layer(stochastic_mode=True)
    out1, out2 = seeded_run(layer, 7)[0], seeded_run(layer, 7)[0]
    assert torch.isfinite(out1).all() and torch.equal(out1, out2)   # on CPU still seed-reproducible
    layer.eval()
    assert torch.equal(layer(inputs()[0]), dropout_layer().eval()(inputs()[0]))


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_torch_activation_checkpointing(reentrant):
    """Recomputation redraws the same dropout masks: gradients equal the uncheckpointed run."""
    layer = dropout_layer()
    plain = seeded_run(layer, 3)
    wrapped = lambda x, m: torch_checkpoint(layer, x, m, use_reentrant=reentrant)
    x, grad = inputs()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out, dx = run(wrapped, x, padding_mask(), grad)
    assert torch.equal(out, plain[0]) and torch.equal(dx, plain[1])
    for p, g in zip(layer.parameters(), plain[2]):
        assert torch.equal(p.grad, g)


def test_under_deepspeed_checkpointing():
    from deepspeed.runtime.activation_checkpointing import checkpointing

    try:
        checkpointing.checkpoint(lambda t: t * 2, torch.ones(1, requires_grad=True))
    except NotImplementedError:
        pytest.skip("deepspeed.checkpointing.checkpoint is not implemented on this branch yet")
    layer = dropout_layer()
    plain = seeded_run(layer, 3)
    x, grad = inputs()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out, _ = run(lambda x_, m: checkpointing.checkpoint(layer, x_, m), x, padding_mask(), grad)
    assert_rel(out, plain[0], 1e-6, "output")
    for p, g in zip(layer.parameters(), plain[2]):
        assert_rel(p.grad, g, 1e-6, "grad")


# ---------------------------------------------------------------- memory flags

def saved_bytes_run(layer, seed=5):
    """seeded_run, also returning the bytes autograd keeps for backward (distinct storages,
    parameters excluded), counted with saved_tensors_hooks."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = seeded_run(layer, seed)
    return result, sum(storages.values())


@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-ln", "pre-ln"])
@pytest.mark.parametrize("flag", FLAGS + ("all",))
def test_memory_flags_save_bytes_and_keep_values(flag, pre_ln):
    base, base_bytes = saved_bytes_run(dropout_layer(pre_layer_norm=pre_ln))
    flags = dict.fromkeys(FLAGS if flag == "all" else (flag,), True)
    res, flag_bytes = saved_bytes_run(dropout_layer(pre_layer_norm=pre_ln, **flags))
    tokens = B * S
    least = {"normalize_invertible": (1 + pre_ln) * tokens * H * 4,   # LayerNorm inputs not kept
             "gelu_checkpoint": tokens * I * 4,                       # GELU output not kept
             "attn_dropout_checkpoint": B * HEADS * S * S * 5}        # probabilities + bool mask
    expect = sum(least.values()) if flag == "all" else least[flag]
    assert base_bytes - flag_bytes >= expect, (base_bytes, flag_bytes)
    assert torch.equal(res[0], base[0])                               # forward unchanged
    rel = 1e-5 if "normalize_invertible" in flags else 1e-6           # x_hat recovered from the output
    assert_rel(res[1], base[1], rel, "input grad")
    for name, a, b in zip(UPSTREAM_NAMES, res[2], base[2]):
        assert_rel(a, b, rel, name)


def test_flags_without_dropout_match_hf():
    ref = hf_layer()
    ours = DeepSpeedTransformerLayer(make_config(**dict.fromkeys(FLAGS, True)), *hf_tensors(ref))
    x, grad = inputs()
    ref_out, ref_dx = run(ref, x, padding_mask(), grad)
    out, dx = run(ours, x, padding_mask(), grad)
    assert_rel(out, ref_out, 1e-5, "output")
    assert_rel(dx, ref_dx, 1e-5, "input grad")
    ref_grads = hf_grads(ref)
    for name, p in ours.named_parameters():
        assert_rel(p.grad, ref_grads[name], 1e-5, name)


# ---------------------------------------------------------------- CUDA (when a GPU is lent)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    cpu = DeepSpeedTransformerLayer(make_config(), *hf_tensors(hf_layer()))
    gpu = DeepSpeedTransformerLayer(make_config(**dict.fromkeys(FLAGS, True)), *hf_tensors(hf_layer()))
    gpu.to("cuda", dtype)
    x, grad = inputs()
    ref_out, ref_dx = run(cpu, x, padding_mask(), grad)
    out, dx = run(gpu, x.to("cuda", dtype), padding_mask(dtype).cuda(), grad.to("cuda", dtype))
    rel = 1e-4 if dtype == torch.float32 else 4e-2    # TF32 may be on for fp32 matmuls
    assert_rel(out.float().cpu(), ref_out, rel, "output")
    assert_rel(dx.float().cpu(), ref_dx, rel, "input grad")
    drop = dropout_layer(attn_dropout_checkpoint=True).to("cuda", dtype)
    a = seeded_run_device(drop, 4, dtype)
    b = seeded_run_device(drop, 4, dtype)
    assert torch.equal(a, b)


def seeded_run_device(layer, seed, dtype):
    x, grad = inputs()
    torch.manual_seed(seed)
    out, _ = run(layer, x.to("cuda", dtype), padding_mask(dtype).cuda(), grad.to("cuda", dtype))
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_replaces_layers_inside_hf_bert_model(attn):
    """Swapped into transformers' BertModel, whose encoder passes its own mask (additive for eager,
    boolean or None for SDPA) and keyword arguments: the same hidden states as HF's layers."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=50, hidden_size=H, intermediate_size=I, num_attention_heads=HEADS, num_hidden_layers=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn)
    torch.manual_seed(0)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    ids = torch.randint(0, 50, (B, S))
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, S - 5:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        model.encoder.layer = torch.nn.ModuleList(
            DeepSpeedTransformerLayer(make_config(layer_norm_eps=cfg.layer_norm_eps), *hf_tensors(layer)).eval()
            for layer in model.encoder.layer)
        actual = model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    assert_rel(actual, expected, 1e-5, "last_hidden_state")
