"""The tree's habits, checked where the tests run (README's test command, which .ci/run runs): one format
(`ruff format`), a clean `ruff check`, the type checker clean on the service packages (`mypy`, configured in
pyproject.toml), no service module over 400 lines and no two modules with the same name."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = ("planner_svc", "executor_svc", "cache_svc", "gateway_svc", "protos", "deltaserve")
MAX_MODULE_LINES = 400
# Names every service may have one of (its gRPC server, its client, its settings) and the package/pytest files.
SHARED_NAMES = {"__init__.py", "__main__.py", "conftest.py", "server.py", "client.py", "config.py"}
SKIPPED_DIRS = {".venv", "venv", "build", "dist", "__pycache__", "node_modules"}


def run_tool(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    print(output)
    assert result.returncode == 0, f"`{' '.join(args)}` failed (exit {result.returncode}):\n{output}"


def generated(path: Path) -> bool:
    return "_pb2" in path.name


def python_files() -> list[Path]:
    """Every .py file of the tree, outside virtualenvs, build outputs and hidden directories."""
    return [
        path
        for path in ROOT.rglob("*.py")
        if not any(part in SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(ROOT).parts[:-1])
        and not any(part.endswith(".egg-info") for part in path.relative_to(ROOT).parts)
    ]


def test_ruff_format_check():
    run_tool("ruff", "format", "--check", ".")


def test_ruff_check():
    run_tool("ruff", "check", ".")


def test_mypy():
    run_tool("mypy")


def test_no_service_module_over_400_lines():
    long = {}
    for package in SERVICE_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if generated(path):
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_two_modules_share_a_name():
    by_name = collections.defaultdict(list)
    for path in python_files():
        if path.name not in SHARED_NAMES and not generated(path):
            by_name[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"modules sharing a file name: {shared}"


def test_package_data_holds_every_kernel_source_and_proto():
    """An install from a wheel (the Dockerfile's `pip install /src`) holds only what package-data names: every C
    kernel source the executor builds at load and every .proto must be among it."""
    import glob
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for package in SERVICE_PACKAGES:
        shipped = {
            path
            for pattern in package_data.get(package, [])
            for path in glob.glob(pattern, root_dir=ROOT / package)
        }
        for path in (ROOT / package).rglob("*"):
            if path.suffix in (".c", ".proto") and str(path.relative_to(ROOT / package)) not in shipped:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"not in pyproject.toml's package-data, so missing from a wheel: {missing}"
