"""The GPU tier's own conftest: the helper directories its tests borrow from, and the `checkpoints` fixture.

Every gpu-marked test lives in tests/gpu (tests/conftest.py enforces it), but several of them drive
helpers written for their CPU siblings: tp_group / ep_group and test_ep_forward's RANK_STEPS in
tests/distributed, weight_helpers / sync_helpers and the in-process pairs of test_nccl_backend and
test_sharded_rdt_backend in tests/weights, test_engine_release's collector_off in tests/engine. The tests import those as top-level modules, which works
in their own directories only because pytest's default ("prepend") import mode puts each test
file's directory on sys.path; from tests/gpu it puts only tests/gpu there. So those directories
are appended here, before any test module of this directory is imported. Appended, not prepended:
a name in tests/gpu (or the repository root, first through pyproject's `pythonpath`) still wins.
Spawned child processes (the nccl engine process, the TP/EP ranks) inherit this sys.path.
"""

from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _helpers in ("weights", "distributed", "engine"):
    _path = os.path.join(_TESTS, _helpers)
    if _path not in sys.path:
        sys.path.append(_path)


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoint):
    """checkpoints(arch) -> (old_dir, new_dir): the same architecture with seeds 0 and 1 (as in tests/weights)."""

    def build(arch: str):
        return tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)

    return build
