"""Running `deltaserve` from the tests: its parser with a given environment (and its usage errors), a
command run to its end, a serving command in its own process, and ports to give them."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.cli import parse_args

REPO = Path(__file__).resolve().parent.parent


def parse(argv: list[str], **environ: str):
    return parse_args(argv, environ)


def usage_error(capsys, argv: list[str], **environ: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(argv, **environ)
    assert exited.value.code == 2
    return capsys.readouterr().err


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port for a process started later. Below Linux's ephemeral range (32768-60999): a port the kernel hands
    out for port 0 can be taken, before the process binds it, as the local end of another process's
    connection (gloo's, grpc's), which made `up` and the split stages fail to listen now and then."""
    while True:
        port = random.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def cli_env() -> dict[str, str]:
    """The environment for `python -m deltaserve` run from the repo, installed or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def deltaserve(*argv: str) -> subprocess.CompletedProcess:
    """Runs one `deltaserve` command to its end."""
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", *argv],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=120,
    )


def deltaserve_json(*argv: str):
    done = deltaserve(*argv, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class Serving:
    """A serving `deltaserve` command in its own process, JSON log lines to a file."""

    def __init__(
        self,
        log_path: Path,
        *argv: str,
        own_group: bool = False,
        module: str = "deltaserve",
        env: dict[str, str] | None = None,
    ):
        """own_group: in a process group (and session) of its own, as a service manager starts it. `module`:
        what runs (`python -m`) in place of deltaserve's own CLI, e.g. tests/up_fault.py; `env`: added to
        the command's environment."""
        self.log_path = log_path
        with open(log_path, "w") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, "--log-json", *argv],
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                env={**cli_env(), **(env or {})},
                cwd=REPO,
                start_new_session=own_group,
            )

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def wait_listening(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            listening = [event for event in self.events() if event["event"] == "listening"]
            if listening:
                return listening[0]
            assert self.process.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"no listening line within {timeout:g} s"
            time.sleep(0.2)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """SIGTERM (or `sig`), then the exit code (a clean stop logs "stopping", then "stopped" last)."""
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)
