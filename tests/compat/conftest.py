"""The compat tier: our server and engines checked against vLLM 0.33's own code and a real vLLM's answers.

Fixture `vllm_import`: import_vllm, or a skip naming the reason when the vLLM 0.33 build is missing
(`make vllm033` builds it; `make test` runs that first). `make test` sets ROLLOUT_REQUIRE_COMPAT=1:
then the fixture fails instead of skipping, and any test under tests/compat that still ends up
skipped, for whatever reason, fails the session - the tier cannot go quietly missing in CI. That
session check lives in tests/conftest.py: under pytest-xdist (`make test` runs two workers) only
the top conftest is loaded by the controlling process, which sees every worker's reports and owns
the exit status; a worker's own exit status would be dropped.
"""

from __future__ import annotations

import os

import pytest

from compat.vllm_modules import import_vllm, unavailable_reason

REQUIRE_ENV = "ROLLOUT_REQUIRE_COMPAT"


def compat_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def skip_or_fail(reason: str) -> None:
    """Skip with `reason` - or fail with it when the tier is required (make test)."""
    if compat_required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: the compat tier must run, not skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_import():
    """import_vllm(name) -> vLLM 0.33 module; skips (fails under make test) when the build is missing."""
    reason = unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)
    return import_vllm
