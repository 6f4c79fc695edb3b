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


@pytest.fixture(scope="module")
def launch_server():
    """launch_server(model, *flags) -> LaunchedServer; each is stopped with SIGTERM at module end,
    asserting a clean exit and that no child process survives."""
    from server_launch import launch

    started = []

    def start(model: str, *args: str):
        server = launch(model, *args)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            rc = server.stop()
            assert rc == 0, f"server exited with {rc}:\n{server.stderr_tail()}"
