"""The GPU tier's layout check (tests/conftest.py): a gpu-marked test outside tests/gpu, or an unmarked one
inside it, stops collection with a usage error that names the test.

Each case runs pytest in a subprocess on a throwaway tree that holds a copy of tests/conftest.py, so the
check under test is the real one; plugin autoloading is off there, only the layout is being collected.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
INI = """\
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    gpu: needs CUDA
"""
MARKED_MODULE = "import pytest\n\npytestmark = pytest.mark.gpu\n\n\ndef test_on_the_gpu():\n    pass\n"


def _collect(root: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    (root / "tests").mkdir(parents=True)
    shutil.copy(CONFTEST, root / "tests" / "conftest.py")
    (root / "pytest.ini").write_text(INI)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "tests"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_tree_that_keeps_the_rule_collects(tmp_path):
    result = _collect(tmp_path, {
        "tests/gpu/test_kernel.py": MARKED_MODULE,
        "tests/weights/test_cpu_only.py": "def test_on_the_cpu():\n    pass\n",
    })
    assert result.returncode == 0, result.stdout + result.stderr  # the gpu test passes or skips (no CUDA)


def test_a_misplaced_gpu_test_and_an_unmarked_one_in_tests_gpu_stop_collection_naming_both(tmp_path):
    result = _collect(tmp_path, {
        "tests/gpu/test_kernel.py": MARKED_MODULE,
        "tests/gpu/test_forgot_the_marker.py": "def test_unmarked():\n    pass\n",
        "tests/weights/test_backend.py": """\
            import pytest


            def test_on_the_cpu():
                pass


            @pytest.mark.gpu
            def test_real_nccl():
                pass
        """,
    })
    output = result.stdout + result.stderr
    assert result.returncode == 4, output  # pytest's usage error: nothing ran
    assert "no tests ran" in output
    assert "tests/weights/test_backend.py::test_real_nccl: marked gpu but outside tests/gpu" in output
    assert "tests/gpu/test_forgot_the_marker.py::test_unmarked: under tests/gpu but not marked gpu" in output
    assert "test_on_the_gpu" not in output and "test_on_the_cpu" not in output  # only the offenders are named
