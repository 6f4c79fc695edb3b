"""Fixtures for the RL control-plane tests: `launch_server` from tests/server, reused as is."""

from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "_rl_server_fixtures"
_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server", "conftest.py")
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _path)
    sys.modules[_NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_NAME])

launch_server = sys.modules[_NAME].launch_server
