"""Runs a test script in a child Python under Triton's interpreter, on CPU (TRITON_INTERPRET must be set before
triton is first imported, so never in the test process itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Put at the top of a script whose kernels loop: Triton 3.6's interpreter int()s 1-element arrays in loops,
# which NumPy >= 2.4 refuses; the script then exits 77 and run_interpreted skips the test, saying why.
LOOP_PROBE = r"""
import sys
import torch
import triton
import triton.language as tl

@triton.jit
def _probe(out_ptr, n):
    for i in range(0, n, 1):
        if tl.load(out_ptr + i) >= 0:
            tl.store(out_ptr + i, i)

try:
    _probe[(1,)](torch.zeros(2), 2)
except Exception as e:
    print(f"interpreter cannot run loops here: {e!r}")
    sys.exit(77)
"""


def run_interpreted(script: str, *args: str, timeout: float = 300) -> str:
    """Runs `script` (python -c, with args) from the repository root under the interpreter; returns its stdout.
    Exit code 77 skips the test with the script's message; any other failure fails it with the child's output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script, *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
