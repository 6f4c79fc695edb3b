"""The import mechanism itself: vLLM 0.33's modules come from the unpacked wheel, nothing compiled
from vLLM is loaded, and a missing build skips - or, under `make test`, fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compat.vllm_modules import SITE, VERSION, loaded_compiled_modules

WEIGHT_TRANSFER = [
    "vllm.config.weight_transfer",
    "vllm.distributed.weight_transfer",
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.clients",
    "vllm.distributed.weight_transfer.nccl_common",
    "vllm.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.packed_tensor",
    "vllm.distributed.weight_transfer.ipc_engine",
    "vllm.distributed.weight_transfer.sparse_nccl_engine",
]
WIDER = ["vllm.entrypoints.rl.online.api_router", "vllm.v1.metrics.loggers"]


def run_python(code: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (the import hooks are process-wide), with tests/ importable as here."""
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("name", WEIGHT_TRANSFER + WIDER)
def test_module_comes_from_the_wheel(vllm_import, name):
    module = vllm_import(name)
    assert Path(module.__file__).resolve().is_relative_to(SITE.resolve()), module.__file__
    assert loaded_compiled_modules() == []


def test_version_metadata_is_033(vllm_import):
    import importlib.metadata

    vllm_import("vllm.distributed.weight_transfer.base")
    assert importlib.metadata.version("vllm") == VERSION


def test_weight_transfer_alone_leaves_vllm_config_unloaded(vllm_import):
    """Only the needed modules: importing the weight-transfer modules must not run vllm/config/__init__
    (which would import every config class and most of vLLM's dependencies)."""
    vllm_import("vllm")  # the build is there; the check itself runs in a fresh interpreter
    proc = run_python(
        f"""
        import sys
        from compat.vllm_modules import import_vllm
        for name in {WEIGHT_TRANSFER!r}:
            import_vllm(name)
        config = sys.modules["vllm.config"]
        assert "VllmConfig" not in vars(config), "vllm.config's __init__ ran"
        assert "vllm.config.model" not in sys.modules
        assert "vllm._C" not in sys.modules
        # Asking the shell for a name it lacks runs the real __init__ then.
        assert config.WeightTransferConfig is sys.modules["vllm.config.weight_transfer"].WeightTransferConfig
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_import_vllm_rejects_other_names():
    from compat.vllm_modules import import_vllm

    with pytest.raises(ValueError, match="not a vllm module"):
        import_vllm("torch")


def test_missing_build_skips_and_fails_when_required(tmp_path):
    """With the build missing the fixture skips with the reason; with ROLLOUT_REQUIRE_COMPAT=1 (make
    test) the same run fails, and so does a compat test that skips for any other reason."""
    test_file = Path(__file__).resolve().parent / "test_vllm_import.py"
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::test_version_metadata_is_033"]
    env = dict(os.environ, ROLLOUT_VLLM033_BUILD=str(tmp_path / "absent"))
    env.pop("ROLLOUT_REQUIRE_COMPAT", None)
    repo = Path(__file__).resolve().parents[2]
    skipped = subprocess.run(base + ["-rs"], capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert "1 skipped" in skipped.stdout and "make vllm033" in skipped.stdout, skipped.stdout[-3000:]
    env["ROLLOUT_REQUIRE_COMPAT"] = "1"
    failed = subprocess.run(base, capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "the compat tier must run, not skip" in failed.stdout, failed.stdout[-3000:]


def test_any_compat_skip_fails_when_required():
    """The session check (tests/conftest.py) for tests/compat: a skip of any kind there fails `make test`."""
    compat_dir = Path(__file__).resolve().parent
    probe = compat_dir / f"_skip_probe_{os.getpid()}.py"  # not test_*.py: collected only when named
    probe.write_text("import pytest\n\ndef test_skips():\n    pytest.skip('some other reason')\n")
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)]
        env = dict(os.environ)
        env.pop("ROLLOUT_REQUIRE_COMPAT", None)
        repo = compat_dir.parents[1]
        relaxed = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo, timeout=300)
        assert relaxed.returncode == 0, relaxed.stdout[-3000:]
        env["ROLLOUT_REQUIRE_COMPAT"] = "1"
        strict = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo, timeout=300)
        assert strict.returncode == 1, strict.stdout[-3000:]
        assert "1 compat test(s) skipped" in strict.stdout and "some other reason" in strict.stdout
    finally:
        probe.unlink(missing_ok=True)
