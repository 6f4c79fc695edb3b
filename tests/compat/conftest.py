"""The compat tier: our server and engines checked against vLLM 0.33's own code and a real vLLM's answers.

Fixture `vllm_import`: import_vllm, or a skip naming the reason when the vLLM 0.33 build is missing
(`make vllm033` builds it; `make test` runs that first). `make test` sets ROLLOUT_REQUIRE_COMPAT=1:
then the fixture fails instead of skipping, and any test under tests/compat that still ends up
skipped, for whatever reason, fails the session - the tier cannot go quietly missing in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compat.vllm_modules import import_vllm, unavailable_reason

COMPAT_DIR = Path(__file__).resolve().parent
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


_compat_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and COMPAT_DIR in Path(str(report.fspath)).resolve().parents:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _compat_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if compat_required() and _compat_skips:
        lines = "\n  ".join(_compat_skips)
        message = f"{REQUIRE_ENV}=1 but {len(_compat_skips)} compat test(s) skipped:\n  {lines}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n" + message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
