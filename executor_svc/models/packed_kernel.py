"""The packed weights' CPU kernel (packed_kernel.c): built once per machine with the system C compiler into
the user's cache directory, loaded with ctypes.

Plain C with OpenMP, no torch headers, so a build takes about a second. Its OpenMP is the one torch already
loaded (the same libgomp.so.1), so the kernel and torch's ops share one thread pool instead of fighting over
the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "packed_kernel.c")
# No FMA contraction: each weight is rounded as gguf's de-quantization rounds it (see packed_kernel.c).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
MAX_ROWS = (
    8  # packed_kernel.c's MAX_ROWS: more rows go through a de-quantized scratch matrix and torch's GEMM
)


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: packed weights cannot run on this machine."""


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


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel; KernelUnavailable saying why when it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc) on PATH to build the packed-weight kernel")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode() + _cpu_flags()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"packed_kernel-{key}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        # Built under a temporary name and renamed: executors starting together never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        result = subprocess.run([compiler, *_FLAGS, "-o", tmp, _SOURCE], capture_output=True, text=True)
        if result.returncode:
            os.unlink(tmp)
            raise KernelUnavailable(
                f"building the packed-weight kernel failed: {result.stderr.strip()[:500]}"
            )
        os.replace(tmp, path)
        log.info("built the packed-weight kernel into %s", path)
    lib = ctypes.CDLL(path)
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.packed_matmul.argtypes = [c_int, c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.packed_dequantize.argtypes = [c_int, c_int, ptr, ptr, ptr, i64, ptr, i64, ptr, c_int]
    return lib


def available() -> bool:
    try:
        library()
    except KernelUnavailable as e:
        log.warning("%s", e)
        return False
    return True


def matmul(
    bits: int, offset: int, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """x[M <= MAX_ROWS, K] float32 contiguous @ the packed w[N, K]^T -> [M, N] float32."""
    n, k = scale.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    library().packed_matmul(
        bits,
        offset,
        q.data_ptr(),
        scale.data_ptr(),
        minv.data_ptr(),
        n,
        k,
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def dequantize(
    bits: int,
    offset: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor,
    k: int,
    rows: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The packed rows `rows` (int64; all when None) as float32 into out[count, K]; returns out."""
    count = scale.shape[0] if rows is None else rows.shape[0]
    library().packed_dequantize(
        bits,
        offset,
        q.data_ptr(),
        scale.data_ptr(),
        minv.data_ptr(),
        k,
        None if rows is None else rows.data_ptr(),
        count,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
