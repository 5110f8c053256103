"""scripts/compose_e2e.py's docker and compose plumbing: the daemon (the running one, or one started here),
the compose command, the images built from Debian's packages (torch the way this host's pip gets it), the
override file and the `docker compose` calls on the stack."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.compose_e2e_util import Timer, free_port, log, run

TORCH_VERSION = "2.13.0"


def start_daemon(work: Path, cleanup: contextlib.ExitStack) -> dict:
    """The environment for docker commands: the running daemon's, or a daemon of our own started here."""
    env = dict(os.environ)
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        log("using the running docker daemon")
        return env
    root = work / "docker"
    sock = root / "docker.sock"
    root.mkdir()
    daemon_log = open(work / "dockerd.log", "w")
    daemon = subprocess.Popen(
        [
            "dockerd",
            "--storage-driver=vfs",
            "--bridge=none",
            "--iptables=false",
            f"--data-root={root / 'data'}",
            f"--exec-root={root / 'exec'}",
            f"--pidfile={root / 'dockerd.pid'}",
            f"--host=unix://{sock}",
        ],
        stdout=daemon_log,
        stderr=subprocess.STDOUT,
    )

    def stop_daemon() -> None:
        daemon.terminate()
        daemon.wait(60)
        daemon_log.close()
        # What it leaves mounted under its roots (the network namespace file), deepest first.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
            subprocess.run(["umount", "--lazy", mount], check=False)
        log(f"stopped the docker daemon (pid {daemon.pid}) started here")

    cleanup.callback(stop_daemon)
    env["DOCKER_HOST"] = f"unix://{sock}"
    for _ in range(120):
        if subprocess.run(["docker", "info"], capture_output=True, env=env).returncode == 0:
            log(f"started dockerd (pid {daemon.pid}, vfs, no bridge) on {sock}")
            return env
        time.sleep(0.5)
    raise RuntimeError(f"dockerd did not answer in 60 s; see {work / 'dockerd.log'}")


def compose_command(env: dict) -> list[str]:
    # The pip wheel's CLI sits beside this interpreter, on PATH only where its venv is activated.
    beside = str(Path(sys.executable).parent / "docker-compose")
    for command in (["docker", "compose"], ["docker-compose"], [beside]):
        if shutil.which(command[0]) is None:
            continue
        done = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, env=env)
        if done.returncode == 0 and not done.stdout.startswith("1."):
            log(f"compose: {' '.join(command)} {done.stdout.strip()}")
            return command
    raise RuntimeError("no compose v2+: install Docker's compose plugin, or pip install '.[compose]'")


def torch_build_args(work: Path, cleanup: contextlib.ExitStack) -> list[str]:
    """Get the CPU torch the way this host's pip does: when pip here resolves torch to a +cpu wheel (a
    local wheel directory or index), serve that wheel to the build on loopback; else PyTorch's CPU index."""
    wheels = work / "wheels"
    run(sys.executable, "-m", "pip", "download", "--no-deps", f"torch=={TORCH_VERSION}", "-d", str(wheels))
    (wheel,) = wheels.glob("torch-*.whl")
    if "+cpu" not in wheel.name:
        log(f"pip here gives {wheel.name}: the image takes torch from PyTorch's CPU index")
        return []
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", str(wheels)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cleanup.callback(server.terminate)
    log(f"serving {wheel.name} to the build on 127.0.0.1:{port}")
    return [
        "--build-arg",
        f"WHEELS_URL=http://127.0.0.1:{port}/",
        "--build-arg",
        "TORCH_CPU_INDEX=https://pypi.org/simple",
    ]


def override(image: str, volume: str, ports: dict[str, int]) -> str:
    """Host networking on free ports, the image built here, a fresh volume: only what the test changes."""
    cache = f"127.0.0.1:{ports['cache']}"
    services = {
        "cache": {},
        "executor": {"DELTASERVE_CACHE": cache},
        "planner": {"DELTASERVE_CACHE": cache, "DELTASERVE_EXECUTOR": f"127.0.0.1:{ports['executor']}"},
    }
    lines = ["services:"]
    for name, extra in services.items():
        lines += [
            f"  {name}:",
            f"    image: {image}",
            "    pull_policy: never",
            "    network_mode: host",
            "    ports: !reset []",
            "    expose: !reset []",
            "    environment:",
            "      DELTASERVE_HOST: 127.0.0.1",
            f'      DELTASERVE_PORT: "{ports[name]}"',
            *(f"      {key}: {value}" for key, value in extra.items()),
        ]
    lines += ["volumes:", "  snapshots:", f"    name: {volume}"]
    return "\n".join(lines) + "\n"


class Stack:
    """`docker compose` on compose.yaml + compose.cpu.yaml + the test's override, in project `name`."""

    def __init__(self, compose: list[str], env: dict, name: str, override_file: Path) -> None:
        files = ["-f", "compose.yaml", "-f", "compose.cpu.yaml", "-f", str(override_file)]
        self.command = [*compose, "--project-name", name, *files]
        self.env = env

    def __call__(self, *args: str, timeout: float = 900) -> str:
        return run(*self.command, *args, env=self.env, timeout=timeout, quiet=True)

    def up(self) -> None:
        try:
            self("up", "--detach", "--no-build", "--wait", "--wait-timeout", "600")
        except RuntimeError:  # a service that failed to start says why in its own log
            for service in ("cache", "executor", "planner"):
                tail = self("logs", "--no-log-prefix", "--tail", "20", service).strip()
                log(f"{service}'s last log lines:\n{tail or '(none)'}")
            raise

    def container(self, service: str) -> dict:
        (cid,) = self("ps", "--all", "--quiet", service).split()
        return json.loads(run("docker", "inspect", cid, env=self.env, quiet=True))[0]

    def logs(self, service: str) -> list[dict]:
        return [json.loads(line) for line in self("logs", "--no-log-prefix", service).splitlines() if line]


def build_images(env: dict, work: Path, run_id: str, timer: Timer, cleanup: contextlib.ExitStack) -> str:
    """The base image from Debian's packages and the CPU image on it; both removed at the end."""
    base, image = f"deltaserve-e2e-base:{run_id}", f"deltaserve-e2e:cpu-{run_id}"
    cleanup.callback(
        lambda: subprocess.run(["docker", "rmi", "--force", image, base], env=env, capture_output=True)
    )
    with timer("base image from Debian packages (debootstrap + import)"):
        run("bash", "docker/base_image.sh", base, env=env, quiet=True)
    torch_args = torch_build_args(work, cleanup)
    with timer("CPU image build"):
        run(
            "docker",
            "build",
            "--network",
            "host",
            "-f",
            "docker/Dockerfile",
            "-t",
            image,
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            "TORCH_VARIANT=cpu",
            *torch_args,
            ".",
            env={**env, "DOCKER_BUILDKIT": "0"},
            quiet=True,
        )
    size = run("docker", "image", "inspect", "--format", "{{.Size}}", image, env=env, quiet=True)
    log(f"image {image}: {int(size) / 2**30:.2f} GiB")
    return image
