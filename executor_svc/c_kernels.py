"""The CPU's small C kernels (packed weights, paged decode attention): each built once per machine with the
system C compiler into the user's cache directory, loaded with ctypes.

Plain C with OpenMP, no torch headers, so a build takes about a second. Its OpenMP is the one torch already
loaded (the same libgomp.so.1), so a kernel and torch's ops share one thread pool instead of fighting over
the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: the kernel cannot run on this machine."""


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deltaserve", "kernels")


def _cpu_flags() -> bytes:
    # -march=native builds for this CPU: a cache shared between machines must not hand out another's build.
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)


def _source_with_includes(path: str) -> bytes:
    """The file's bytes and those of every file it includes by a quoted path, recursively: what a build's
    cache key must cover (a kernel file may include another). KernelUnavailable where one is missing (an install
    that left it out)."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise KernelUnavailable(f"reading the kernel source {path} failed: {e}") from None
    for name in _INCLUDE.findall(source):
        source += _source_with_includes(os.path.join(os.path.dirname(path), name.decode()))
    return source


@functools.cache
def build(source_path: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The C file at source_path built with flags (and -shared -fPIC, linked with libm) and loaded; KernelUnavailable saying why
    when it cannot be built. A cached build that will not load (cut short by a crash, made against another
    libc) is built again once."""
    name = os.path.splitext(os.path.basename(source_path))[0]
    # $CC as make reads it: a program and its arguments ("ccache gcc", "gcc -m64")
    try:
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    except ValueError as e:  # an unbalanced quote
        raise KernelUnavailable(f"$CC cannot be read as a command ({e}) to build the {name} kernel") from None
    if not compiler[0]:
        raise KernelUnavailable(f"no C compiler (cc) on PATH to build the {name} kernel")
    source = _source_with_includes(source_path)
    command = [*compiler, *flags, "-shared", "-fPIC"]
    key = hashlib.sha256(source + " ".join(command).encode() + _cpu_flags()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"{name}-{key}.so")
    if os.path.exists(path):
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            log.warning("loading the cached %s kernel from %s failed (%s); building it again", name, path, e)
    _compile(name, command, source_path, path)
    try:
        return ctypes.CDLL(path)
    except OSError as e:  # built just now, and not loadable
        raise KernelUnavailable(f"loading the {name} kernel from {path} failed: {e}") from None


def _compile(name: str, command: list[str], source_path: str, path: str) -> None:
    try:
        os.makedirs(_cache_dir(), exist_ok=True)
        # Built under a temporary name, flushed to disk and renamed: executors starting together never load a
        # half-written file, nor does one after a crash.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    except OSError as e:  # a home that is not this user's, a read-only disk
        raise KernelUnavailable(f"no place to build the {name} kernel: {e}") from None
    os.close(fd)
    try:
        result = subprocess.run([*command, "-o", tmp, source_path, "-lm"], capture_output=True, text=True)
    except OSError as e:  # $CC naming no program, or one that cannot run
        os.unlink(tmp)
        raise KernelUnavailable(f"running the C compiler {shlex.join(command[:1])} failed: {e}") from None
    if result.returncode:
        os.unlink(tmp)
        raise KernelUnavailable(f"building the {name} kernel failed: {result.stderr.strip()[:500]}")
    with open(tmp, "rb") as built:
        os.fsync(built.fileno())
    os.replace(tmp, path)
    log.info("built the %s kernel into %s", name, path)


def build_or_none(source_path: str, flags: tuple[str, ...], instead: str) -> ctypes.CDLL | None:
    """build(), or None where the kernel cannot be built or loaded, with a warning naming the reason and
    `instead`, what serves in its place."""
    try:
        return build(source_path, flags)
    except KernelUnavailable as e:
        log.warning("%s; %s instead", e, instead)
        return None
