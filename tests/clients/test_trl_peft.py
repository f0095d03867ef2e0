"""TRL and PEFT run unchanged on this deepspeed: 2 ranks on CPU under the `deepspeed` launcher,
SFT (TRL's fused LM-head loss, gradient checkpointing on), DPO with its reference model, GRPO with
generation (TRL's unwrap_model_for_generation, no vLLM) at ZeRO-2 and ZeRO-3, PEFT LoRA at ZeRO-3.
Each is compared, step by step, with the same 2-rank job under plain DDP (see trl_peft_worker.py
for the tolerance). Tiny Llama from a config, tokenizer and data made in memory: nothing is
downloaded. At ZeRO-3, SFT/DPO/GRPO failed in backward with `The size of tensor a (0) must match
...` (issue 31 A.1: [Note: automatic external parameters]) and GRPO on leaving generation with
`'ParameterOffloadView' object has no attribute '_register_deepspeed_module'`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from test_hf_clients import run_under_deepspeed_launcher  # noqa: E402

VARIANTS = ["sft:2", "sft:3", "dpo:2", "dpo:3", "grpo:2", "grpo:3", "lora:3"]


def test_trl_and_peft_match_ddp_under_deepspeed_launcher(tmp_path):
    result = run_under_deepspeed_launcher("trl_peft_worker.py", tmp_path, VARIANTS)
    for name, r in result.items():
        assert len(r["deepspeed"]) == len(r["ddp"]) == 3, name
        assert r["worst_rel"] <= 1e-6, (name, r)
    assert all(row["reward"] >= 0 for row in result["grpo:3"]["deepspeed"])
