"""load_format="dummy": the engine builds the model from config.json alone, with random weights, and serves."""

from __future__ import annotations

import shutil

import pytest

from engine import LLM, SamplingParams


def test_dummy_weights_need_no_safetensors_and_still_generate(tiny_checkpoint, tmp_path):
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_checkpoint("qwen3"), config_only)
    (config_only / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        LLM(str(config_only), device="cpu", max_model_len=64)
    llm = LLM(str(config_only), device="cpu", max_model_len=64, load_format="dummy")
    norms = [p for n, p in llm.engine_core.executor.worker.model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(config_only), device="cpu", load_format="npz")
