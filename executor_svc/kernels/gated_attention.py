"""The Qwen3.5 gated attention layer's elementwise work in a decode step or a prefill batch, in two Triton
kernels: the q and k head norms with partial rope and the K/V page write (before the attention), and the
output gate (after it). Each rounds where the torch model rounds (qwen3_5_model's OffsetRMSNorm,
rope_partial, sigmoid gate). A program takes one head of ROWS rows: one in a decode step, whose launch stays
a program a row and head; a block of them in a prefill's thousands of tokens, where starting one-row programs
costs more than their bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.dependent import await_inputs, dependent

DECODE_ROWS = 256  # the widest batch still launched a program a row and head on 4 warps (a decode step's)
# Wider batches (a prefill's): 16 rows a program on 8 warps, two rows a warp, 16 bytes a load; on sm90 the
# norm kernel takes 61 registers a thread and the gate 32, without spills (4 warps would take 132 and 37)
PREFILL_ROWS, PREFILL_WARPS = 16, 8


def _rows_and_warps(batch: int, rows_per_program: int | None, warps: int | None) -> tuple[int, int]:
    """A launch's rows a program and warps for `batch` rows: each as given, else its default."""
    wide = batch > DECODE_ROWS
    rows = rows_per_program if rows_per_program is not None else PREFILL_ROWS if wide else 1
    warps = warps if warps is not None else PREFILL_WARPS if wide else 4
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows}")
    if warps not in (1, 2, 4, 8, 16, 32):  # a program of at most 1024 threads
        raise ValueError(f"warps must be a power of two up to 32, got {warps}")
    return rows, warps


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
    batch,
    mixed_row_stride,
    table_stride,
    pool_page_stride,
    pool_offset_stride,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    ROWS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_inputs(DEPENDENT)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    live = row < batch  # the last block's rows past the batch load and store nothing
    head = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, D)[None, :]  # [1, D]
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
    x = tl.load(x_at + cols, mask=live).to(tl.float32)  # [ROWS, D]
    # On a GPU the sum adds up in the order of the tile's layout, which a block of rows changes (a row alone
    # over 4 warps, a block's rows a warp each): a value can then differ by a unit in the last place, rarely
    inv_rms = tl.rsqrt(tl.sum(x * x, 1, keep_dims=True) / D + eps)
    # As OffsetRMSNorm: x * inv_rms * (1 + w) in float32 (the norm weights come as 1 + w), then the dtype
    normed = (x * inv_rms * tl.load(norm_ptr + cols)).to(dtype).to(tl.float32)
    partner_x = tl.load(x_at + partner, mask=live).to(tl.float32)
    other = (partner_x * inv_rms * tl.load(norm_ptr + partner)).to(dtype)
    other = tl.where(cols < half, -other.to(tl.float32), other.to(tl.float32))
    position = tl.load(positions_ptr + row, mask=live)
    rotated = cols < ROT
    at_position = position * table_stride + cols
    cos = tl.load(cos_ptr + at_position, mask=rotated & live, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + at_position, mask=rotated & live, other=0.0).to(tl.float32)
    # rope as torch rounds it: x * cos and rotate_half(x) * sin each rounded, then their sum
    turned = ((normed * cos).to(dtype).to(tl.float32) + (other * sin).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where(rotated, turned, normed.to(dtype))
    if head < HEADS:
        tl.store(q_out_ptr + (row * HEADS + head) * D + cols, out, mask=live)
    else:
        page = tl.load(write_page_ptr + row, mask=live).to(tl.int64)
        at = (
            page * pool_page_stride
            + tl.load(write_offset_ptr + row, mask=live) * pool_offset_stride
            + kv_head * D
            + cols
        )
        tl.store(k_pool_ptr + at, out.to(k_pool_ptr.dtype.element_ty), mask=live)
        v_at = mixed_ptr + row * mixed_row_stride + 2 * HEADS * D + (KV_HEADS + kv_head) * D + cols
        v = tl.load(v_at, mask=live)
        tl.store(v_pool_ptr + at, v.to(v_pool_ptr.dtype.element_ty), mask=live)


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
    *,
    rows_per_program: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """mixed[B, 2 H D + 2 KVH D] (each query head's D then its gate's D, then k, then v; rows may be strided)
    -> q[B, H, D]: each q and k head RMS-normed by its (1 + w) weights (q_norm, k_norm f32[D]), rope on the first
    rotary dims (cos, sin: [max_seq_len, rotary_dim] tables at positions[B]); k and v written to the pool layers
    [pages, page_size, KVH, D] at (write_page[B], write_offset[B]). rows_per_program (a power of two) and
    warps override the launch's defaults: a row on 4 warps up to DECODE_ROWS rows, else PREFILL_ROWS on
    PREFILL_WARPS."""
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
    rows, warps = _rows_and_warps(batch, rows_per_program, warps)
    q = torch.empty(batch, heads, head_dim, dtype=mixed.dtype, device=mixed.device)  # q: [B, H, D]
    _norm_rope_kv_write_kernel[(triton.cdiv(batch, rows), heads + kv_heads)](
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
        batch,
        mixed.stride(0),
        cos.stride(0),
        k_pool_layer.stride(0),
        k_pool_layer.stride(1),
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=head_dim,
        ROT=rot,
        ROWS=rows,
        num_warps=warps,
        **dependent(mixed.device),
    )
    return q


@triton.jit
def _gate_kernel(
    out_ptr,
    mixed_ptr,
    gated_ptr,
    batch,
    out_row_stride,
    out_head_stride,
    mixed_row_stride,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_inputs(DEPENDENT)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    live = row < batch  # the last block's rows past the batch load and store nothing
    head = tl.program_id(1)
    cols = tl.arange(0, D)[None, :]  # [1, D]
    dtype = gated_ptr.dtype.element_ty
    out = tl.load(out_ptr + row * out_row_stride + head * out_head_stride + cols, mask=live).to(tl.float32)
    gate = tl.load(mixed_ptr + row * mixed_row_stride + (2 * head + 1) * D + cols, mask=live).to(tl.float32)
    # As torch: sigmoid(gate) rounded to the dtype, then the product rounded
    tl.store(
        gated_ptr + (row * HEADS + head) * D + cols,
        (out * tl.sigmoid(gate).to(dtype).to(tl.float32)).to(dtype),
        mask=live,
    )


def output_gate(
    out: torch.Tensor, mixed: torch.Tensor, *, rows_per_program: int | None = None, warps: int | None = None
) -> torch.Tensor:
    """out[B, H, D] (the attention's, contiguous along D) * sigmoid(each head's gate in mixed, as norm_rope_kv_write
    reads it) -> [B, H * D]. rows_per_program and warps as norm_rope_kv_write's."""
    batch, heads, head_dim = out.shape
    if out.stride(2) != 1 or mixed.stride(1) != 1 or mixed.shape[0] != batch:
        raise ValueError("out and mixed [B, ...] must be contiguous along their last dim")
    rows, warps = _rows_and_warps(batch, rows_per_program, warps)
    gated = torch.empty(batch, heads * head_dim, dtype=out.dtype, device=out.device)  # gated: [B, H * D]
    _gate_kernel[(triton.cdiv(batch, rows), heads)](
        out,
        mixed,
        gated,
        batch,
        out.stride(0),
        out.stride(1),
        mixed.stride(0),
        HEADS=heads,
        D=head_dim,
        ROWS=rows,
        num_warps=warps,
        **dependent(out.device),
    )
    return gated
