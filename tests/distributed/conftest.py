"""Fixtures of the tensor-parallel tests: one two-rank gloo group shared by the session's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tp_group():
    from tp_group import TPGroup

    group = TPGroup(2)
    try:
        assert group.run("rank_info") == [{"rank": 0, "size": 2}, {"rank": 1, "size": 2}]
        yield group
    finally:
        group.close()
