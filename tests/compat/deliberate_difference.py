"""The warning test_recorded_answers.py reports a deliberate difference from vLLM with.

In a module of its own, not in the test file: pytest-xdist's controller rebuilds a worker's warning
by importing its class's module, and it imports compat.* (tests/ is on its sys.path) but not test
modules, which only the workers import.
"""


class DeliberateDifference(UserWarning):
    """An exchange where ours answers differently from vLLM on purpose (DELIBERATELY_DIFFERENT)."""
