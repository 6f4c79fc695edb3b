"""Fixtures for the output-side tests: the tiny byte-level BPE tokenizer, built offline."""

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.tiny_models import builtin_model_dir

    return AutoTokenizer.from_pretrained(builtin_model_dir("tiny-llama"))
