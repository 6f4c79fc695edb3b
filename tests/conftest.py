"""Shared fixtures: tiny HF-format checkpoints built offline once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


GPU_DIR = Path(__file__).resolve().parent / "gpu"  # the one home of the GPU tier


def misplaced_gpu_tests(items, gpu_dir: Path = GPU_DIR) -> list[str]:
    """One line per collected test that breaks "gpu-marked if and only if under tests/gpu".

    The marker itself is asked (get_closest_marker), not item.keywords: keywords also hold the names
    of the item's parent nodes, so every test under a directory called gpu would have "gpu" there."""
    problems = []
    for item in items:
        inside = gpu_dir in Path(item.path).resolve().parents
        marked = item.get_closest_marker("gpu") is not None
        if marked and not inside:
            problems.append(f"{item.nodeid}: marked gpu but outside tests/gpu (move it to tests/gpu)")
        elif inside and not marked:
            problems.append(f"{item.nodeid}: under tests/gpu but not marked gpu (add pytestmark = pytest.mark.gpu)")
    return problems


def pytest_collection_modifyitems(config, items):
    problems = misplaced_gpu_tests(items)
    if problems:
        raise pytest.UsageError(
            "GPU tests live in tests/gpu, and every test there is marked gpu "
            "(benchmarks/run_gpu.sh runs `pytest tests/gpu -m gpu`):\n  " + "\n  ".join(problems)
        )
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
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
