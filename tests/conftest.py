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


COMPAT_DIR = Path(__file__).resolve().parent / "compat"
REQUIRE_COMPAT_ENV = "ROLLOUT_REQUIRE_COMPAT"  # tests/compat/conftest.py: set, a compat skip fails the run
# Test files that start or join a local Ray cluster. The engine's Ray executor joins any cluster
# running on the node (ray.init(address="auto")), so two of these at once under pytest-xdist could
# share one cluster and shut it down under each other: they all run in one xdist group, one at a time.
RAY_FILES = {
    "executor/test_ray_executor.py",
    "rollout/test_ray_workers.py",
    "rollout/test_tp_dp_fleet.py",
    "trainers/test_disaggregated.py",
    "weights/test_sharded_rdt_backend.py",
}


def xdist_group_name(item) -> str:
    """A test's pytest-xdist group under `--dist loadgroup`: its file (module-scoped servers and
    fixtures start once, as without xdist), or "ray" for every file of RAY_FILES."""
    relative = Path(item.path).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    return "ray" if relative in RAY_FILES else relative


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (make test runs two)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(xdist_group_name(item)))
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


_compat_skips: list[str] = []


def pytest_runtest_logreport(report):
    """Notes every skip under tests/compat (in the xdist controller too: it gets each worker's reports)."""
    if report.skipped and COMPAT_DIR in Path(str(report.fspath)).resolve().parents:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _compat_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    """With ROLLOUT_REQUIRE_COMPAT=1 (make test) any compat skip fails the session."""
    if os.environ.get(REQUIRE_COMPAT_ENV, "") not in ("", "0") and _compat_skips:
        lines = "\n  ".join(_compat_skips)
        message = f"{REQUIRE_COMPAT_ENV}=1 but {len(_compat_skips)} compat test(s) skipped:\n  {lines}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n" + message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
