"""zero_to_fp32 on pipeline checkpoints: DeepSpeed 0.19.8's own (tests/fixtures/ds_0_19_8_pipe,
2 stages x 2 ranks, ZeRO-1) consolidates into one state dict whose values are the layers'
weights (fp32 training: the layer files hold exactly the fp32 masters)."""

import os

import torch

from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_0_19_8_pipe")


def test_pipeline_checkpoint_consolidates():
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURE, tag="ckpt")
    want = {"tied_modules.embed.weight"} | {f"{i}.fc.{k}" for i in range(1, 7) for k in ("weight", "bias")}
    assert set(state) == want
    ckpt = os.path.join(FIXTURE, "ckpt")
    embed = torch.load(os.path.join(ckpt, "layer_00-model_states.pt"), weights_only=True)
    torch.testing.assert_close(state["tied_modules.embed.weight"], embed["weight"], rtol=0, atol=0)
    for i in range(1, 7):
        layer = torch.load(os.path.join(ckpt, f"layer_{i:02d}-model_states.pt"), weights_only=True)
        for k, v in layer.items():
            torch.testing.assert_close(state[f"{i}.{k}"], v, rtol=0, atol=0)   # the same fp32 values, copied


def test_pipeline_checkpoint_into_sequential():
    """The documented helper: the same layer specs as one nn.Sequential with the checkpoint's weights."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
    import pipe_jobs as jobs

    from deepspeed.runtime.pipe.checkpoint import load_pipeline_checkpoint_into_sequential

    model = load_pipeline_checkpoint_into_sequential(jobs.specs(), FIXTURE, tag="ckpt")
    state = get_fp32_state_dict_from_zero_checkpoint(FIXTURE, tag="ckpt")
    embed, blocks = jobs.reference_layers()
    with torch.no_grad():
        embed.weight.copy_(state["tied_modules.embed.weight"])
        for i, b in enumerate(blocks):
            b.fc.weight.copy_(state[f"{i + 1}.fc.weight"])
            b.fc.bias.copy_(state[f"{i + 1}.fc.bias"])
    ids = torch.randint(0, jobs.VOCAB, (3, jobs.SEQ))
    torch.testing.assert_close(model(ids), jobs.reference_forward(embed, blocks, ids))
    assert model[0] is model[-1].shared   # tied: one module
