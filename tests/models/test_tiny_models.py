"""The offline tiny checkpoints load in HF, their tokenizer works, and the registry names bad architectures."""

from __future__ import annotations

import os

import pytest
import torch

from engine.models.registry import ARCHITECTURES, resolve_model_class
from engine.tiny_models import BUILTIN_TINY_MODELS, builtin_model_dir, make_tiny_checkpoint, train_tokenizer

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_checkpoint_loads_in_hf(tmp_path, arch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_checkpoint(tmp_path, arch)
    for name in FILES:
        assert os.path.exists(os.path.join(path, name)), name
    config = AutoConfig.from_pretrained(path)
    expected_arch = {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }[arch]
    assert config.architectures == [expected_arch] and resolve_model_class(config) is ARCHITECTURES[expected_arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == "<|endoftext|>" and config.eos_token_id == tokenizer.eos_token_id
    if arch in ("qwen3", "qwen3_moe"):
        assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    if arch == "qwen3_moe":  # experts are stored per expert, as on the hub
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("Hello world")["input_ids"]])).logits
    assert logits.std() > 0.5  # a healthy spread, so greedy argmax is not decided by float noise


def test_tokenizer_round_trips_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path, "qwen2"))
    text = "café, naïve, 日本語, emoji 🙂 — Zürich!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(special)["input_ids"]) == 1


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer().to_str() == train_tokenizer().to_str()


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    a = load_file(f"{make_tiny_checkpoint(tmp_path / 'a', 'llama', seed=3)}/model.safetensors")
    b = load_file(f"{make_tiny_checkpoint(tmp_path / 'b', 'llama', seed=3)}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_builtin_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = builtin_model_dir("tiny-qwen3")
    assert path.startswith(str(tmp_path)) and os.path.exists(os.path.join(path, "model.safetensors"))
    assert builtin_model_dir("tiny-qwen3") == path  # built once
    with pytest.raises(ValueError, match="tiny-llama3-rope"):
        builtin_model_dir("tiny-unknown")
    assert set(BUILTIN_TINY_MODELS) >= {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama3-rope"}


def test_registry_error_names_architectures():
    class Config:
        architectures = ["FooForCausalLM"]

    with pytest.raises(ValueError, match="architectures") as info:
        resolve_model_class(Config())
    assert "FooForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)
