"""The Qwen3.5 gated attention layer's elementwise work in a decode step, in two Triton kernels: the q and k
head norms with partial rope and the K/V page write (before the attention), and the output gate (after it).
Each rounds where the torch model rounds (qwen3_5_model's OffsetRMSNorm, rope_partial, sigmoid gate)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.dependent import await_inputs, dependent


@triton.jit
def _norm_rope_kv_write_kernel(
    mixed_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    q_out_ptr,
    k_pool_ptr,
    v_pool_ptr,
    write_page_ptr,
    write_offset_ptr,
    mixed_row_stride,
    table_stride,
    pool_page_stride,
    pool_offset_stride,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_inputs(DEPENDENT)
    row, head = tl.program_id(0), tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    half = ROT // 2
    # rotate_half's partner of each rotated dim (its sign below); the other dims pass through
    partner = tl.where(cols < half, cols + half, tl.where(cols < ROT, cols - half, cols))
    kv_head = head - HEADS
    # a row's mixed projection: per query head [query D | gate D], then k [KVH, D], then v [KVH, D]
    if head < HEADS:
        x_at = mixed_ptr + row * mixed_row_stride + head * 2 * D
        norm_ptr = q_norm_ptr
    else:
        x_at = mixed_ptr + row * mixed_row_stride + 2 * HEADS * D + kv_head * D
        norm_ptr = k_norm_ptr
    x = tl.load(x_at + cols).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    # As OffsetRMSNorm: x * inv_rms * (1 + w) in float32 (the norm weights come as 1 + w), then the dtype
    normed = (x * inv_rms * tl.load(norm_ptr + cols)).to(dtype).to(tl.float32)
    other = (tl.load(x_at + partner).to(tl.float32) * inv_rms * tl.load(norm_ptr + partner)).to(dtype)
    other = tl.where(cols < half, -other.to(tl.float32), other.to(tl.float32))
    position = tl.load(positions_ptr + row)
    rotated = cols < ROT
    cos = tl.load(cos_ptr + position * table_stride + cols, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * table_stride + cols, mask=rotated, other=0.0).to(tl.float32)
    # rope as torch rounds it: x * cos and rotate_half(x) * sin each rounded, then their sum
    turned = ((normed * cos).to(dtype).to(tl.float32) + (other * sin).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where(rotated, turned, normed.to(dtype))
    if head < HEADS:
        tl.store(q_out_ptr + (row * HEADS + head) * D + cols, out)
    else:
        page = tl.load(write_page_ptr + row).to(tl.int64)
        at = (
            page * pool_page_stride
            + tl.load(write_offset_ptr + row) * pool_offset_stride
            + kv_head * D
            + cols
        )
        tl.store(k_pool_ptr + at, out.to(k_pool_ptr.dtype.element_ty))
        v = tl.load(mixed_ptr + row * mixed_row_stride + 2 * HEADS * D + (KV_HEADS + kv_head) * D + cols)
        tl.store(v_pool_ptr + at, v.to(v_pool_ptr.dtype.element_ty))


def norm_rope_kv_write(
    mixed: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_pool_layer: torch.Tensor,
    v_pool_layer: torch.Tensor,
    write_page: torch.Tensor,
    write_offset: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """mixed[B, 2 H D + 2 KVH D] (each query head's D then its gate's D, then k, then v; rows may be strided)
    -> q[B, H, D]: each q and k head RMS-normed by its (1 + w) weights (q_norm, k_norm f32[D]), rope on the first
    rotary dims (cos, sin: [max_seq_len, rotary_dim] tables at positions[B]); k and v written to the pool layers
    [pages, page_size, KVH, D] at (write_page[B], write_offset[B])."""
    batch, width = mixed.shape
    _, _, kv_heads, head_dim = k_pool_layer.shape
    rot = cos.shape[1]
    if width != 2 * (heads + kv_heads) * head_dim or mixed.stride(1) != 1:
        raise ValueError(
            f"mixed must be [B, {2 * (heads + kv_heads) * head_dim}] contiguous along its last dim"
        )
    if head_dim & (head_dim - 1) or rot % 2 or rot > head_dim or sin.shape != cos.shape:
        raise ValueError(f"head_dim {head_dim} must be a power of two, rotary dims {rot} even and within it")
    if any(t.shape != (head_dim,) or t.dtype != torch.float32 for t in (q_norm, k_norm)):
        raise ValueError(f"q_norm and k_norm must be float32 [{head_dim}]")
    if v_pool_layer.shape != k_pool_layer.shape or not (
        k_pool_layer.is_contiguous() and v_pool_layer.is_contiguous()
    ):
        raise ValueError("the pool layers must be contiguous and of one shape")
    q = torch.empty(batch, heads, head_dim, dtype=mixed.dtype, device=mixed.device)  # q: [B, H, D]
    _norm_rope_kv_write_kernel[(batch, heads + kv_heads)](
        mixed,
        q_norm,
        k_norm,
        cos,
        sin,
        positions,
        q,
        k_pool_layer,
        v_pool_layer,
        write_page,
        write_offset,
        mixed.stride(0),
        cos.stride(0),
        k_pool_layer.stride(0),
        k_pool_layer.stride(1),
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=head_dim,
        ROT=rot,
        **dependent(mixed.device),
    )
    return q


@triton.jit
def _gate_kernel(
    out_ptr,
    mixed_ptr,
    gated_ptr,
    out_row_stride,
    out_head_stride,
    mixed_row_stride,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_inputs(DEPENDENT)
    row, head = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, D)
    dtype = gated_ptr.dtype.element_ty
    out = tl.load(out_ptr + row * out_row_stride + head * out_head_stride + cols).to(tl.float32)
    gate = tl.load(mixed_ptr + row * mixed_row_stride + (2 * head + 1) * D + cols).to(tl.float32)
    # As torch: sigmoid(gate) rounded to the dtype, then the product rounded
    tl.store(
        gated_ptr + (row * HEADS + head) * D + cols,
        (out * tl.sigmoid(gate).to(dtype).to(tl.float32)).to(dtype),
    )


def output_gate(out: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """out[B, H, D] (the attention's, contiguous along D) * sigmoid(each head's gate in mixed, as norm_rope_kv_write
    reads it) -> [B, H * D]."""
    batch, heads, head_dim = out.shape
    if out.stride(2) != 1 or mixed.stride(1) != 1 or mixed.shape[0] != batch:
        raise ValueError("out and mixed [B, ...] must be contiguous along their last dim")
    gated = torch.empty(batch, heads * head_dim, dtype=out.dtype, device=out.device)  # gated: [B, H * D]
    _gate_kernel[(batch, heads)](
        out,
        mixed,
        gated,
        out.stride(0),
        out.stride(1),
        mixed.stride(0),
        HEADS=heads,
        D=head_dim,
        **dependent(out.device),
    )
    return gated
