"""The CPU decode attention that reads K/V in place off the pages (paged_cpu.c), built and loaded by
executor_svc.c_kernels; the torch decode uses it for float32 KV on the CPU where it builds."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from executor_svc.c_kernels import build_or_none

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_cpu.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (logged once) where it cannot be built: the gathering torch path serves."""
    lib = build_or_none(_SOURCE, _FLAGS, "the CPU decode attention gathers the pages")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr]
    lib.paged_decode_attention.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    return lib


def serves(kv_k: torch.Tensor) -> bool:
    """Whether the kernel can read this pool's K/V: float32 on the CPU, and the kernel builds here."""
    return kv_k.device.type == "cpu" and kv_k.dtype == torch.float32 and library() is not None


def decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    attn_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """torch_ref.decode_attention without the gathered copy: q[B, H, D] -> [B, H, D] float32.

    k_layer, v_layer: [pages, page_size, kv_heads, head_dim] contiguous float32; block_tables: int32[B, W]
    contiguous; attn_lens: int32[B] (each >= 1). q's heads and dims contiguous (its rows may be strided).
    """
    lib = library()
    assert lib is not None, "paged_cpu.decode_attention called where serves() is False"
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_layer.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_layer.data_ptr(),
        v_layer.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        attn_lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
