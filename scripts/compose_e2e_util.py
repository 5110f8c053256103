"""scripts/compose_e2e.py's helpers: the repo root, timestamped log lines, commands run from the repo root, free
loopback ports, and the timer behind the figures it prints."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(*command: str, env: dict | None = None, timeout: float = 1800, quiet: bool = False) -> str:
    """Runs a command, returns its stdout; on failure raises with its output."""
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    if not quiet and done.stderr.strip():
        print(done.stderr.strip()[-2000:], flush=True)
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timer:
    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        yield
        self.figures[name] = time.monotonic() - start
        log(f"{name}: {self.figures[name]:.1f} s")
