"""Write docker/constraints.txt: the versions of deltaserve's runtime dependencies, and theirs, as installed in
this environment (one whose tests pass), so an image built later installs the same ones and not whatever the
index holds that day. torch and triton are left out: the image installs its own build of torch first
(TORCH_VERSION, its CPU or CUDA wheel), and the CUDA wheel pins its triton.

    python scripts/image_constraints.py           # after `pip install -e '.[test]'` and a green test run
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docker", "constraints.txt")
# torch: the image's own build; triton: the one its CUDA wheel pins (xgrammar takes any); deltaserve: the source
LEFT_OUT = {"torch", "triton", "deltaserve"}


def runtime_closure(root: str) -> dict[str, str]:
    """name -> installed version of every package `root` needs to run (no extras), torch's side left out."""
    pinned: dict[str, str] = {}
    todo = [root]
    while todo:
        dist = distribution(todo.pop())
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(requirement.name)
            if name in pinned or name in LEFT_OUT:
                continue
            try:
                pinned[name] = distribution(name).version
            except PackageNotFoundError:
                raise SystemExit(
                    f"{name} (needed by {dist.metadata['Name']}) is not installed here"
                ) from None
            todo.append(name)
    return pinned


def main() -> None:
    pinned = runtime_closure("deltaserve")
    lines = [f"{name}=={version}" for name, version in sorted(pinned.items())]
    header = "# Written by scripts/image_constraints.py: the runtime dependencies as tested, but torch and triton.\n"
    with open(OUT, "w") as out:
        out.write(header + "\n".join(lines) + "\n")
    print(f"{OUT}: {len(lines)} packages")


if __name__ == "__main__":
    main()
