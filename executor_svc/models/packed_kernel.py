"""The packed weights' CPU kernel (packed_kernel.c), built and loaded by executor_svc.c_kernels."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from executor_svc.c_kernels import KernelUnavailable, build

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "packed_kernel.c")
# No FMA contraction: each weight is rounded as gguf's de-quantization rounds it (see packed_kernel.c), the
# norms and rope of the C decode step as torch rounds them (dense_cpu.c).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
# packed_kernel.c's MAX_ROWS: more rows go through a de-quantized scratch matrix and torch's GEMM
MAX_ROWS = 8


@functools.cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built with `flags` (this machine's own by default); KernelUnavailable saying why when it
    cannot be built."""
    lib = build(_SOURCE, flags)
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.packed_matmul.argtypes = [c_int, c_int, c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.packed_dequantize.argtypes = [c_int, c_int, c_int, ptr, ptr, ptr, i64, ptr, i64, ptr, c_int]
    return lib


def available() -> bool:
    try:
        library()
    except KernelUnavailable as e:
        log.warning("%s", e)
        return False
    return True


def matmul(
    bits: int, offset: int, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    """x[M <= MAX_ROWS, K] float32 contiguous @ the packed w[N, K]^T -> [M, N] float32. scale and minv
    float32 or both float16; minv None: all zero."""
    n, k = scale.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    library().packed_matmul(
        bits,
        offset,
        scale.dtype == torch.float16,
        q.data_ptr(),
        scale.data_ptr(),
        None if minv is None else minv.data_ptr(),
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
    minv: torch.Tensor | None,
    k: int,
    rows: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The packed rows `rows` (int64; all when None) as float32 into out[count, K]; returns out."""
    count = scale.shape[0] if rows is None else rows.shape[0]
    library().packed_dequantize(
        bits,
        offset,
        scale.dtype == torch.float16,
        q.data_ptr(),
        scale.data_ptr(),
        None if minv is None else minv.data_ptr(),
        k,
        None if rows is None else rows.data_ptr(),
        count,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
