"""Writes tiny, randomly initialised HF-format checkpoints (config, weights, tokenizer) offline for tests and examples."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a checkpoint is built: the CLI reads the names without it
    import torch
    from torch import nn

# Bump when the written files change, so cached builtin models are rebuilt.
_FORMAT_VERSION = 1

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small built-in corpus: enough English for ~250 merges, plus multi-byte text so
# byte-level fallbacks (accents, CJK, emoji) are exercised by tests.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog did not mind; it was asleep in the sun.",
    "Once upon a time there was a small model that wanted to learn how to write stories. "
    "Every day it read a few sentences, counted the words, and tried to guess what came next.",
    "Reinforcement learning from human feedback trains a policy to produce answers that people prefer. "
    "A rollout is a sample from the policy; the trainer scores it and updates the weights.",
    "An inference engine keeps a cache of keys and values for every request. The cache is split into "
    "blocks of a fixed size, so memory can be shared and reused without copying long sequences.",
    "The scheduler decides which requests run in each step. It hands out tokens under one budget, "
    "so a long prompt can be processed in chunks while other requests keep decoding.",
    "Numbers appear too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2024, 3.14159, and 1e-5.",
    "Questions and answers: What is the capital of France? Paris. What is two plus two? Four.",
    "User: Hello! How are you today?\nAssistant: I am fine, thank you. How can I help you?",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # prints 3",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A journey of a thousand miles begins with a single step. Practice makes progress, not perfection.",
    "Non-ASCII text: café, naïve, résumé, façade, jalapeño, Zürich, straße, 日本語, 中文, 한국어, "
    "emoji 🙂 🚀 ✨, Ελληνικά, русский.",
    "Tiny models are useful for tests because they load in milliseconds and run on any laptop CPU.",
]

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_DEFAULT_SHAPES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)
_ARCH_DEFAULTS = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
    # Every layer sparse (override decoder_sparse_step / mlp_only_layers for dense ones, which use intermediate_size).
    "qwen3_moe": dict(
        tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}

# name -> (arch, config overrides)
BUILTIN_TINY_MODELS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", {}),
    "tiny-qwen2": ("qwen2", {}),
    "tiny-qwen3": ("qwen3", {}),
    "tiny-qwen3-moe": ("qwen3_moe", {}),
    "tiny-llama3-rope": (
        "llama",
        {
            # Small original_max_position_embeddings so all three frequency bands
            # (kept, smoothed, divided by factor) occur with head_dim 16.
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Trains a deterministic byte-level BPE tokenizer on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merge counts are well separated (fewer ties).
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def _torch_dtype(dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype!r} is not supported; use float32, bfloat16 or float16") from None


def _reinit_weights(model: nn.Module) -> None:
    """Re-initialises weights with a large std so logits spread well beyond float noise."""
    import torch
    from torch import nn

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0)
            elif isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
                if name.endswith("lm_head"):
                    # logits std ~2; when tied this also rescales the shared embedding,
                    # which is harmless because the first layer norms its input.
                    std *= 2.0
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                # Norm weights near 1 but not exactly, so a wrongly loaded norm shows up.
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() == 3 or name.endswith("mlp.gate.weight"):
                # Stacked MoE experts ([E, out, in]) and the router are not nn.Linear: give them the
                # linear std too, so router logits spread (~1) and top-k choices are not float-noise ties.
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))


def _per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers v5 keeps a MoE layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]); checkpoints on the hub (and save_pretrained) name them per
    expert: `mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`."""
    prefix, _, proj = name.rpartition(".")
    if not prefix.endswith(".experts") or proj not in ("gate_up_proj", "down_proj"):
        return [(name, tensor)]
    out = []
    for e, expert in enumerate(tensor):
        if proj == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", expert))
        else:
            gate, up = expert.chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
    return out


def make_tiny_checkpoint(
    path, arch: str = "llama", *, seed: int = 0, dtype="float32", stacked_experts: bool = False, **config_overrides
) -> str:
    """Writes a tiny random checkpoint of `arch` ("llama", "qwen2", "qwen3", "qwen3_moe") into `path` and returns it.

    MoE experts are written per expert, as hub checkpoints are; stacked_experts=True writes
    transformers v5's in-memory stacked names instead.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch: {arch!r} is not supported; supported: {sorted(_CONFIG_CLASSES)}")
    torch_dtype = _torch_dtype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_vocab_size = tokenizer.get_vocab_size()
    eos_token_id = tokenizer.token_to_id(EOS_TOKEN)

    config_kwargs = dict(_DEFAULT_SHAPES)
    config_kwargs.update(_ARCH_DEFAULTS[arch])
    config_kwargs.update(
        vocab_size=64 * math.ceil(tokenizer_vocab_size / 64),
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    config_kwargs.update(config_overrides)
    config = getattr(transformers, _CONFIG_CLASSES[arch])(**config_kwargs)
    config.architectures = [_ARCHITECTURES[arch]]
    config.dtype = torch_dtype

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_weights(model)
    if config.tie_word_embeddings:
        model.tie_weights()

    state = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: stored once, as the embedding
        pieces = [(name, tensor)] if stacked_experts else _per_expert(name, tensor)
        for piece_name, piece in pieces:
            state[piece_name] = piece.detach().to(torch_dtype).contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2))
    generation_config = {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return str(path)


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollout-toolkit" / "tiny"


def builtin_model_dir(name: str) -> str:
    """Returns the directory of builtin tiny model `name`, building it once into the user cache."""
    if name not in BUILTIN_TINY_MODELS:
        raise ValueError(f"model: {name!r} is not a builtin tiny model; known: {sorted(BUILTIN_TINY_MODELS)}")
    final = _cache_root() / f"{name}-v{_FORMAT_VERSION}"
    if (final / "model.safetensors").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    arch, overrides = BUILTIN_TINY_MODELS[name]
    # Build in a sibling temp dir and rename, so readers never see a half-written model.
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent)
    try:
        make_tiny_checkpoint(tmp, arch, **overrides)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
            # Another process won the race; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
