"""Runs `rollout launch` as a real process on a loopback port and checks it leaves nothing behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (this file is in tests/)
_READY = re.compile(r"^rollout: serving (\S+) at (http://\S+)$")
STARTUP_TIMEOUT_S = 180.0


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    url: str
    served_model: str
    stderr_path: str
    child_pids: list[int] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stderr_tail(self, num_chars: int = 4000) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()[-num_chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signals the server and returns its exit code, asserting that no process of its tree survives."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not exit {timeout}s after signal {sig}:\n{self.stderr_tail()}")
        gone_deadline = time.monotonic() + 10.0
        alive = [p for p in self.child_pids if psutil.pid_exists(p) and _is_running(p)]
        while alive and time.monotonic() < gone_deadline:
            time.sleep(0.1)
            alive = [p for p in alive if _is_running(p)]
        for pid in alive:  # do not leak into other tests, but fail this one
            psutil.Process(pid).kill()
        assert not alive, f"child processes survived the server: {alive}\n{self.stderr_tail()}"
        return rc


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launch(model: str, *args: str) -> LaunchedServer:
    """Starts `python -m rollout.cli launch` on a free port (--port 0) and waits for its ready line."""
    cmd = [
        sys.executable, "-m", "rollout.cli", "launch", "--model", model, "--port", "0",
        "--max-model-len", "256", "--device", "cpu", "--dtype", "float32", "--disable-log-stats", *args,
    ]
    stderr = tempfile.NamedTemporaryFile("w", prefix="rollout-server-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5).strip()
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        match = _READY.match(line)
        if match:
            server = LaunchedServer(proc, match.group(2), match.group(1), stderr.name)
            server.child_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            return server
    proc.kill()
    proc.wait()
    with open(stderr.name, errors="replace") as f:
        raise AssertionError(f"server did not start (rc={proc.returncode}):\n{f.read()[-4000:]}")
