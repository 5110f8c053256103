"""The compose stack end to end: scripts/compose_e2e.py run as it is, its output streamed to the test's.

Runs when the machine can: root, and docker (a daemon answering, or `dockerd`) plus debootstrap, or apt-get to
install `docker.io` and `debootstrap`. Otherwise it skips, saying what is missing. The script makes its own
daemon (own data root), images and compose project under a fresh run id, and removes them at the end.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "compose_e2e.py"


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:  # a wedged daemon: the script starts its own
        return False


def missing_packages() -> list[str]:
    """The Debian packages the script still needs here: docker.io for docker/dockerd, and debootstrap."""
    missing = []
    if shutil.which("docker") is None or not (docker_answers() or shutil.which("dockerd")):
        missing.append("docker.io")
    if shutil.which("debootstrap") is None:
        missing.append("debootstrap")
    return missing


def unmet() -> str | None:
    """Why this machine cannot run the stack, or None when it can (maybe after an apt-get install)."""
    if os.geteuid() != 0:
        return "not root (dockerd and debootstrap need it)"
    missing = missing_packages()
    if missing and shutil.which("apt-get") is None:
        return f"missing {', '.join(missing)} and no apt-get to install them"
    return None


@pytest.mark.compose
@pytest.mark.timeout(3000)
@pytest.mark.skipif(unmet() is not None, reason=str(unmet()))
def test_compose_stack_end_to_end() -> None:
    missing = missing_packages()
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], check=True, env=env, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *missing],
            check=True,
            env=env,
            capture_output=True,
        )
    tail: collections.deque[str] = collections.deque(maxlen=80)
    script = subprocess.Popen(
        [sys.executable, "-u", str(SCRIPT)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert script.stdout is not None
    try:
        for line in script.stdout:
            sys.stdout.write(line)
            tail.append(line)
    finally:
        # The test timed out or was interrupted: on SIGINT the script removes what it made, then exits.
        if script.poll() is None:
            script.send_signal(signal.SIGINT)
            try:
                script.wait(300)
            except subprocess.TimeoutExpired:
                script.kill()
    code = script.wait()
    if code != 0:
        pytest.fail(
            f"scripts/compose_e2e.py exited {code}; its output's last lines:\n{''.join(tail)}", pytrace=False
        )
