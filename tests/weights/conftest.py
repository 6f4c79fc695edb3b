"""Fixtures for the weight-update tests: two tiny checkpoints (seeds 0 and 1) per architecture."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoint):
    """checkpoints(arch) -> (old_dir, new_dir): the same architecture with seeds 0 and 1."""

    def build(arch: str):
        return tiny_checkpoint(arch), tiny_checkpoint(arch, seed=1)

    return build
