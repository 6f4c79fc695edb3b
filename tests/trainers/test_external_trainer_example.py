"""examples/external_trainer_http.py runs end to end: a rollout launch server, GRPO steps over HTTP, NCCL (gloo) weight syncs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_external_trainer_example_syncs_every_step_and_logprobs_agree():
    proc = subprocess.run([sys.executable, "examples/external_trainer_http.py", "--steps", "2", "--n", "4"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"step (\d+): reward ([\d.]+)  mismatch \|d\| ([\d.e+-]+)  sync \d+ ms  serving (\S+)", proc.stdout)
    assert [s[0] for s in steps] == ["1", "2"], proc.stdout
    assert [s[3] for s in steps] == ["step-1", "step-2"]  # the server serves each step's weights
    # The server's logprobs of its own samples equal the trainer's: the weights it serves are the trainer's.
    assert all(float(s[2]) < 1e-4 for s in steps)
