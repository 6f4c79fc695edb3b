"""Shared fixtures: tiny HF-format checkpoints built offline once per test session."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch, **overrides) -> directory, built once per distinct request."""
    from engine.tiny_models import make_tiny_checkpoint

    cache: dict[tuple, str] = {}

    def build(arch: str = "llama", **overrides) -> str:
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_checkpoint(path, arch, **overrides)
        return cache[key]

    return build
