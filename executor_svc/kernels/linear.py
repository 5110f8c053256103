"""Projections fused with what surrounds them: the qkv projection with its RMSNorm (and residual add) before and
rope with the KV page write after; gate_up with its RMSNorm; down with SiLU(gate) * up. The activations between
never go through memory, and a decode layer runs four kernels fewer (120 fewer graph nodes for 30 layers).
Every rounding is where eager torch rounds, so the results match the unfused step's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting

_NORM = tl.constexpr(0)
_SILU_MUL = tl.constexpr(1)
_BLOCK_K = 64
_FILL_PROGRAMS = 128  # below this many output tiles, narrower tiles: more programs share the weight reads


@triton.jit
def _inv_rms(
    x_ptr, residual_ptr, new_residual_ptr, m, live_m, k_in, stride_x, stride_residual, eps, store_sum,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """1 / rms of each row of x + residual: [BLOCK_M] float32; stores the sum (rounded) where store_sum."""
    kk = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k_first in range(0, k_in, BLOCK_K):
        k = k_first + kk
        live = live_m[:, None] & (k < k_in)[None, :]
        total = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=live, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + m[:, None] * stride_residual + k[None, :], mask=live, other=0.0)
            total = (total.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if store_sum:
                tl.store(new_residual_ptr + m[:, None] * k_in + k[None, :], total, mask=live)
        total32 = total.to(tl.float32)
        squares += tl.sum(total32 * total32, 1)
    return tl.rsqrt(squares / k_in + eps)


@triton.jit
def _normed_tile(
    x_ptr, residual_ptr, norm_weight_ptr, m, live_m, k, live_k, stride_x, stride_residual, inv_rms,
    HAS_RESIDUAL: tl.constexpr,
):
    """rmsnorm(x + residual) * norm_weight on columns k: [BLOCK_M, BLOCK_K] in x's dtype."""
    dtype = x_ptr.dtype.element_ty
    live = live_m[:, None] & live_k[None, :]
    total = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=live, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + m[:, None] * stride_residual + k[None, :], mask=live, other=0.0)
        total = (total.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    norm_weight = tl.load(norm_weight_ptr + k, mask=live_k, other=0.0).to(tl.float32)
    # As the torch RMSNorm: normalise in float32, round to the dtype, then scale by the weight.
    normed = (total.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
    return (normed * norm_weight[None, :]).to(dtype)


@triton.jit
def _prologue_linear_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    rows,
    n_out,
    k_in,
    stride_x,
    stride_residual,
    stride_weight,
    stride_out,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
):
    """One program per (row block, output block): its input tile computed on the fly, then the matmul."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    live_m = m < rows
    live_n = n < n_out
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == _NORM:
        # The first column of programs stores x + residual.
        inv_rms = _inv_rms(
            x_ptr, residual_ptr, new_residual_ptr, m, live_m, k_in, stride_x, stride_residual, eps, pid_n == 0,
            HAS_RESIDUAL, BLOCK_M, BLOCK_K,
        )
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_first in range(0, k_in, BLOCK_K):
        k = k_first + kk
        live_k = k < k_in
        if PROLOGUE == _NORM:
            a = _normed_tile(
                x_ptr, residual_ptr, norm_weight_ptr, m, live_m, k, live_k, stride_x, stride_residual, inv_rms,
                HAS_RESIDUAL,
            )
        else:
            live = live_m[:, None] & live_k[None, :]
            gate = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=live, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + m[:, None] * stride_x + k_in + k[None, :], mask=live, other=0.0).to(tl.float32)
            # As eager torch: F.silu rounds to the dtype, then the product rounds again.
            silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            a = (silu * up).to(dtype)
        # w: [BLOCK_N, BLOCK_K], the rows of the weight this program's outputs take
        w = tl.load(weight_ptr + n[:, None] * stride_weight + k[None, :], mask=live_n[:, None] & live_k[None, :], other=0.0)
        if DOT_IN_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + m[:, None] * stride_out + n[None, :], acc.to(dtype), mask=live_m[:, None] & live_n[None, :])


@triton.jit
def _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """x * cos + rotate_half(x) * sin on x's two halves, each product and the sum rounded to x's dtype."""
    lo32 = lo.to(tl.float32)
    hi32 = hi.to(tl.float32)
    new_lo = (lo32 * cos_lo).to(lo.dtype).to(tl.float32) + (-hi32 * sin_lo).to(lo.dtype).to(tl.float32)
    new_hi = (hi32 * cos_hi).to(lo.dtype).to(tl.float32) + (lo32 * sin_hi).to(lo.dtype).to(tl.float32)
    return new_lo.to(lo.dtype), new_hi.to(lo.dtype)


@triton.jit
def _norm_qkv_rope_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    weight_ptr,
    new_residual_ptr,
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    positions_ptr,
    write_page_ptr,
    write_offset_ptr,
    cos_ptr,
    sin_ptr,
    rows,
    k_in,
    stride_x,
    stride_residual,
    stride_weight,
    stride_q_row,
    stride_q_head,
    stride_cos,
    stride_sin,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
):
    """One program per (row block, head of q, k or v): the head's two halves as two accumulators, so rope
    pairs columns within the program; q heads go to q, k and v heads into the pool pages."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live_m = m < rows
    j = tl.arange(0, HALF_BLOCK)
    live_j = j < HALF  # tl.dot needs 16 columns at least: narrow heads are zero-padded
    n_lo = head * 2 * HALF + j
    n_hi = n_lo + HALF
    kk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    inv_rms = _inv_rms(
        x_ptr, residual_ptr, new_residual_ptr, m, live_m, k_in, stride_x, stride_residual, eps, head == 0,
        HAS_RESIDUAL, BLOCK_M, BLOCK_K,
    )
    acc_lo = tl.zeros([BLOCK_M, HALF_BLOCK], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF_BLOCK], tl.float32)
    for k_first in range(0, k_in, BLOCK_K):
        k = k_first + kk
        live_k = k < k_in
        a = _normed_tile(
            x_ptr, residual_ptr, norm_weight_ptr, m, live_m, k, live_k, stride_x, stride_residual, inv_rms,
            HAS_RESIDUAL,
        )
        live_w = live_j[:, None] & live_k[None, :]
        # w_lo, w_hi: [HALF_BLOCK, BLOCK_K], the weight rows of the head's first and second halves
        w_lo = tl.load(weight_ptr + n_lo[:, None] * stride_weight + k[None, :], mask=live_w, other=0.0)
        w_hi = tl.load(weight_ptr + n_hi[:, None] * stride_weight + k[None, :], mask=live_w, other=0.0)
        if DOT_IN_F32:
            a = a.to(tl.float32)
            w_lo = w_lo.to(tl.float32)
            w_hi = w_hi.to(tl.float32)
        acc_lo += tl.dot(a, tl.trans(w_lo), input_precision="ieee")
        acc_hi += tl.dot(a, tl.trans(w_hi), input_precision="ieee")
    lo = acc_lo.to(dtype)  # the projection's output, rounded as the unfused matmul stores it
    hi = acc_hi.to(dtype)
    live = live_m[:, None] & live_j[None, :]
    if head < HEADS + KV_HEADS:  # q and k heads turn by their position
        position = tl.load(positions_ptr + m, mask=live_m, other=0).to(tl.int64)
        cos_at = cos_ptr + position[:, None] * stride_cos + j[None, :]
        sin_at = sin_ptr + position[:, None] * stride_sin + j[None, :]
        cos_lo = tl.load(cos_at, mask=live, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_at + HALF, mask=live, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_at, mask=live, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_at + HALF, mask=live, other=0.0).to(tl.float32)
        lo, hi = _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi)
    if head < HEADS:
        q_at = q_ptr + m[:, None] * stride_q_row + head * stride_q_head + j[None, :]
        tl.store(q_at, lo, mask=live)
        tl.store(q_at + HALF, hi, mask=live)
    else:
        page = tl.load(write_page_ptr + m, mask=live_m, other=0).to(tl.int64)
        offset = tl.load(write_offset_ptr + m, mask=live_m, other=0).to(tl.int64)
        if head < HEADS + KV_HEADS:
            dst = k_pool_ptr + page[:, None] * stride_kp + offset[:, None] * stride_kt + (head - HEADS) * stride_kh
        else:
            dst = v_pool_ptr + page[:, None] * stride_vp + offset[:, None] * stride_vt
            dst += (head - HEADS - KV_HEADS) * stride_vh
        tl.store(dst + j[None, :], lo.to(k_pool_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF + j[None, :], hi.to(k_pool_ptr.dtype.element_ty), mask=live)


def _block_m(rows: int) -> int:
    return min(64, max(16, triton.next_power_of_2(rows)))


def _check_norm_inputs(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> None:
    hidden = x.shape[1]
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    if norm_weight.shape != (hidden,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{hidden}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} contiguous along its last dim, got {tuple(residual.shape)}")


def _check_weight(x: torch.Tensor, weight: torch.Tensor, k_in: int) -> None:
    if weight.dim() != 2 or weight.shape[1] != k_in or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k_in}] contiguous along its last dim, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype}, {weight.dtype}")


def _prologue_linear(
    prologue: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    weight: torch.Tensor,
    k_in: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_weight(x, weight, k_in)
    rows, n_out = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty(rows, k_in, dtype=x.dtype, device=x.device)
    block_m = _block_m(rows)
    row_blocks = triton.cdiv(rows, block_m)
    block_n = 64 if row_blocks * triton.cdiv(n_out, 64) >= _FILL_PROGRAMS else 32
    _prologue_linear_kernel[(row_blocks, triton.cdiv(n_out, block_n))](
        x,
        x if residual is None else residual,
        weight if norm_weight is None else norm_weight,
        weight,
        out,
        out if new_residual is None else new_residual,
        rows,
        n_out,
        k_in,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_BLOCK_K,
        # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584).
        DOT_IN_F32=x.dtype == torch.bfloat16 and interpreting(),
    )
    return out, new_residual


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * norm_weight) @ weight.T and the sum x + residual: x[B, K], weight [N, K] ->
    ([B, N], [B, K]). residual None: no add, and the sum is x itself."""
    _check_norm_inputs(x, residual, norm_weight)
    out, new_residual = _prologue_linear(_NORM.value, x, residual, norm_weight, weight, x.shape[1], eps)
    return out, x if new_residual is None else new_residual


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight.T: gate_up[B, 2I] (gate then up, as the fused gate_up projection lays them),
    weight [N, I] -> [B, N]."""
    if gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [B, 2I] contiguous along its last dim, got {tuple(gate_up.shape)}")
    out, _ = _prologue_linear(_SILU_MUL.value, gate_up, None, None, weight, gate_up.shape[1] // 2, 0.0)
    return out


def norm_qkv_rope(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    heads: int,
    kv_heads: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool_layer: torch.Tensor,
    v_pool_layer: torch.Tensor,
    write_page: torch.Tensor,
    write_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's input projection of B rows: h = rmsnorm(x + residual) * norm_weight, then h @ qkv.T split
    into q [B, H, D], k and v [B, KVH, D] heads; rope ("rotate_half", cos and sin [max_seq_len, D] at
    positions[B]) on q and k; k and v stored in the pool layers [pages, page_size, KVH, D] at (write_page[B],
    write_offset[B]). Returns (q, x + residual); residual None: no add, the sum is x itself."""
    _check_norm_inputs(x, residual, norm_weight)
    rows, hidden = x.shape
    _, _, pool_kv_heads, head_dim = k_pool_layer.shape
    _check_weight(x, qkv_weight, hidden)
    if qkv_weight.shape[0] != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"qkv_weight [{qkv_weight.shape[0]}, {hidden}] does not hold {heads} + 2 x {kv_heads} heads of {head_dim}"
        )
    if pool_kv_heads != kv_heads or v_pool_layer.shape != k_pool_layer.shape or k_pool_layer.dtype != x.dtype:
        raise ValueError(
            f"pool layers must be [pages, page_size, {kv_heads}, {head_dim}] of {x.dtype}, got "
            f"{tuple(k_pool_layer.shape)}, {tuple(v_pool_layer.shape)} of {k_pool_layer.dtype}"
        )
    if cos.shape[1] != head_dim or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos and sin must be [positions, {head_dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if any(t.shape != (rows,) for t in (positions, write_page, write_offset)):
        raise ValueError(f"positions, write_page and write_offset must be [{rows}]")
    if k_pool_layer.stride(3) != 1 or v_pool_layer.stride(3) != 1:
        raise ValueError("the pool layers must be contiguous along head_dim")
    q = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)  # q: [B, H, D]
    new_residual = None if residual is None else torch.empty_like(x)
    block_m = _block_m(rows)
    half = head_dim // 2
    _norm_qkv_rope_kernel[(triton.cdiv(rows, block_m), heads + 2 * kv_heads)](
        x,
        x if residual is None else residual,
        norm_weight,
        qkv_weight,
        x if new_residual is None else new_residual,
        q,
        k_pool_layer,
        v_pool_layer,
        positions,
        write_page,
        write_offset,
        cos,
        sin,
        rows,
        hidden,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        qkv_weight.stride(0),
        q.stride(0),
        q.stride(1),
        cos.stride(0),
        sin.stride(0),
        *k_pool_layer.stride()[:3],
        *v_pool_layer.stride()[:3],
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=half,
        HALF_BLOCK=max(16, triton.next_power_of_2(half)),
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_K=_BLOCK_K,
        DOT_IN_F32=x.dtype == torch.bfloat16 and interpreting(),
    )
    return q, x if new_residual is None else new_residual
