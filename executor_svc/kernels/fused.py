"""Fused elementwise kernels of a decode layer: RMSNorm with the residual add, rope with the KV page write,
SiLU(gate) * up, the gated delta net's gated RMSNorm. Each rounds where eager torch rounds, so the results match the torch model's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.dependent import await_inputs, dependent
from executor_svc.kernels.skinny_gemm import SplitSums

_MLP_BLOCK = 1024


@triton.jit
def _rmsnorm_residual_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    split_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """A row of x (with SPLITS, x_ptr holds a skinny GEMM's float32 sums [SPLITS, B, hidden], added here in split
    order and rounded, as its last split would have) plus its residual, normed."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    dtype = normed_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    await_inputs(DEPENDENT)
    if SPLITS:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(x_ptr + s * split_stride + row * stride_x + cols, mask=live, other=0.0)
        x = total.to(dtype)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=live)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    # As the torch RMSNorm: normalise in float32, round to the input dtype, then scale by the weight.
    normed = (x32 * inv_rms).to(dtype).to(tl.float32) * weight
    tl.store(normed_ptr + row * hidden + cols, normed.to(dtype), mask=live)


def rmsnorm_residual(
    x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[B, hidden] (+ residual[B, hidden]) -> (rmsnorm(sum) * weight, sum); residual None = no add, sum = x.
    x may be a skinny GEMM's split sums (with a residual), added up here."""
    splits = x.sums.shape[0] if isinstance(x, SplitSums) else 0
    values = x.sums[0] if isinstance(x, SplitSums) else x  # values: [B, hidden] (the first split's)
    dtype = x.dtype
    batch, hidden = values.shape
    if weight.shape != (hidden,) or (residual is not None and residual.shape != values.shape):
        raise ValueError(
            f"weight must be [{hidden}] and residual [{batch}, {hidden}], got {tuple(weight.shape)}, "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    if isinstance(x, SplitSums) and (
        residual is None
        or residual.dtype != dtype
        or not x.sums.is_contiguous()
        or x.sums.dtype != torch.float32
    ):
        raise ValueError("split sums take a residual of their dtype, and are contiguous float32")
    if (
        values.stride(1) != 1
        or (residual is not None and residual.stride(1) != 1)
        or not weight.is_contiguous()
    ):
        raise ValueError("x, residual and weight must be contiguous along hidden")
    normed = torch.empty(batch, hidden, dtype=dtype, device=values.device)
    new_residual = (
        values if residual is None else torch.empty(batch, hidden, dtype=dtype, device=values.device)
    )
    block = triton.next_power_of_2(hidden)
    split_stride = batch * hidden if splits else 0  # 0 unused: no specialization on the batch without splits
    _rmsnorm_residual_kernel[(batch,)](
        values,
        values if residual is None else residual,
        weight,
        normed,
        new_residual,
        values.stride(0),
        values.stride(0) if residual is None else residual.stride(0),
        split_stride,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        SPLITS=splits,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),  # about 8 values a thread, whatever the hidden size
        **dependent(values.device),
    )
    return normed, new_residual


@triton.jit
def _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """x * cos + rotate_half(x) * sin on x's two halves, each product and the sum rounded to x's dtype."""
    lo32 = lo.to(tl.float32)
    hi32 = hi.to(tl.float32)
    new_lo = (lo32 * cos_lo).to(lo.dtype).to(tl.float32) + (-hi32 * sin_lo).to(lo.dtype).to(tl.float32)
    new_hi = (hi32 * cos_hi).to(lo.dtype).to(tl.float32) + (lo32 * sin_hi).to(lo.dtype).to(tl.float32)
    return new_lo.to(lo.dtype), new_hi.to(lo.dtype)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    k_pool_ptr,
    v_pool_ptr,
    write_page_ptr,
    write_offset_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_kpp,
    stride_kpt,
    stride_kph,
    stride_vpp,
    stride_vpt,
    stride_vph,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    KV_HEADS_POW2: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per row: rotate its query heads in place, rotate its KV heads into the pool, copy V."""
    await_inputs(DEPENDENT)
    row = tl.program_id(0)
    position = tl.load(positions_ptr + row).to(tl.int64)
    i = tl.arange(0, HALF)
    cos_lo = tl.load(cos_ptr + position * stride_cos + i).to(tl.float32)
    cos_hi = tl.load(cos_ptr + position * stride_cos + HALF + i).to(tl.float32)
    sin_lo = tl.load(sin_ptr + position * stride_sin + i).to(tl.float32)
    sin_hi = tl.load(sin_ptr + position * stride_sin + HALF + i).to(tl.float32)

    h = tl.arange(0, HEADS_POW2)
    real = (h < num_heads)[:, None]
    # q halves: [HEADS_POW2, HALF]
    q_at = q_ptr + row * stride_qb + h[:, None] * stride_qh + i[None, :]
    q_lo = tl.load(q_at, mask=real, other=0.0)
    q_hi = tl.load(q_at + HALF, mask=real, other=0.0)
    q_lo, q_hi = _rotate(q_lo, q_hi, cos_lo[None, :], cos_hi[None, :], sin_lo[None, :], sin_hi[None, :])
    tl.store(q_at, q_lo, mask=real)
    tl.store(q_at + HALF, q_hi, mask=real)

    page = tl.load(write_page_ptr + row).to(tl.int64)
    offset = tl.load(write_offset_ptr + row).to(tl.int64)
    kh = tl.arange(0, KV_HEADS_POW2)
    real_kv = (kh < num_kv_heads)[:, None]
    # k, v halves: [KV_HEADS_POW2, HALF]
    k_at = k_ptr + row * stride_kb + kh[:, None] * stride_kh + i[None, :]
    k_lo = tl.load(k_at, mask=real_kv, other=0.0)
    k_hi = tl.load(k_at + HALF, mask=real_kv, other=0.0)
    k_lo, k_hi = _rotate(k_lo, k_hi, cos_lo[None, :], cos_hi[None, :], sin_lo[None, :], sin_hi[None, :])
    k_dst = k_pool_ptr + page * stride_kpp + offset * stride_kpt + kh[:, None] * stride_kph + i[None, :]
    tl.store(k_dst, k_lo.to(k_pool_ptr.dtype.element_ty), mask=real_kv)
    tl.store(k_dst + HALF, k_hi.to(k_pool_ptr.dtype.element_ty), mask=real_kv)
    v_at = v_ptr + row * stride_vb + kh[:, None] * stride_vh + i[None, :]
    v_dst = v_pool_ptr + page * stride_vpp + offset * stride_vpt + kh[:, None] * stride_vph + i[None, :]
    tl.store(v_dst, tl.load(v_at, mask=real_kv).to(v_pool_ptr.dtype.element_ty), mask=real_kv)
    tl.store(v_dst + HALF, tl.load(v_at + HALF, mask=real_kv).to(v_pool_ptr.dtype.element_ty), mask=real_kv)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool_layer: torch.Tensor,
    v_pool_layer: torch.Tensor,
    write_page: torch.Tensor,
    write_offset: torch.Tensor,
) -> torch.Tensor:
    """Rope ("rotate_half") on q[B, H, D] in place (returned) and on k[B, KVH, D], whose rotated rows and
    v[B, KVH, D] go to the pool layers [pages, page_size, KVH, D] at (write_page[B], write_offset[B]).

    cos, sin: [max_seq_len, D] tables indexed by positions[B]; k and v themselves are left as they are.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (batch, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [{batch}, kv_heads, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k_pool_layer.shape[2:] != (kv_heads, head_dim) or v_pool_layer.shape != k_pool_layer.shape:
        raise ValueError(
            f"pool layers must be [pages, page_size, {kv_heads}, {head_dim}], got {tuple(k_pool_layer.shape)}, "
            f"{tuple(v_pool_layer.shape)}"
        )
    if cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must be [positions, {head_dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if any(t.shape != (batch,) for t in (positions, write_page, write_offset)):
        raise ValueError(f"positions, write_page and write_offset must be [{batch}]")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_pool_layer, v_pool_layer)):
        raise ValueError("q, k, v, cos, sin and the pool layers must be contiguous along head_dim")
    _rope_kv_write_kernel[(batch,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        k_pool_layer,
        v_pool_layer,
        write_page,
        write_offset,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        *k_pool_layer.stride()[:3],
        *v_pool_layer.stride()[:3],
        heads,
        kv_heads,
        HALF=head_dim // 2,
        HEADS_POW2=triton.next_power_of_2(heads),
        KV_HEADS_POW2=triton.next_power_of_2(kv_heads),
        **dependent(q.device),
    )
    return q


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, intermediate, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr
):
    await_inputs(DEPENDENT)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < intermediate
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate + cols, mask=live, other=0.0).to(tl.float32)
    # As eager torch: F.silu rounds to the dtype, then the product rounds again.
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * intermediate + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=live)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up[B, 2I] (gate then up, as a fused gate_up projection lays them) -> SiLU(gate) * up, [B, I]."""
    batch, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [B, 2I] contiguous along its last dim, got {tuple(gate_up.shape)}")
    intermediate = width // 2
    out = torch.empty(batch, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    grid = (batch, triton.cdiv(intermediate, _MLP_BLOCK))
    _silu_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), intermediate, BLOCK=_MLP_BLOCK, **dependent(gate_up.device)
    )
    return out


@triton.jit
def gated_norm(x, gate, weight, size, eps):
    """Gated RMSNorm of one head, x [BD], or of several, x [heads, BD]: x float32 (zeros past `size`), gate in
    the output dtype, weight [BD] float32. As GatedRMSNorm on x rounded to the dtype: norm in float32, round,
    scale by the weight, round, times SiLU(gate) in float32, round; returned in gate's dtype."""
    dtype = gate.dtype
    x = x.to(dtype).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / size + eps)
    normed = ((x * inv_rms).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    gate = gate.to(tl.float32)
    return (normed * (gate * tl.sigmoid(gate))).to(dtype)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    gate_row_stride,
    heads,
    eps,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # this program's heads
    cols = tl.arange(0, BLOCK)
    live = (head < heads)[:, None] & (cols < SIZE)[None, :]
    at = (row * heads + head[:, None]) * SIZE + cols[None, :]  # [HEADS, BLOCK]
    weight = tl.load(weight_ptr + cols, mask=cols < SIZE, other=0.0).to(tl.float32)
    await_inputs(DEPENDENT)
    x = tl.load(x_ptr + at, mask=live, other=0.0)
    gate = tl.load(
        gate_ptr + row * gate_row_stride + head[:, None] * SIZE + cols[None, :], mask=live, other=0.0
    )
    tl.store(out_ptr + at, gated_norm(x, gate, weight[None, :], SIZE, eps), mask=live)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x[N, H, D] (float32, contiguous) -> rmsnorm(x in gate's dtype, per head) * weight[D] * SiLU(gate), where
    gate is [N, H * D] (rows may be strided): [N, H * D] in gate's dtype, the gated delta net's output norm."""
    n, heads, size = x.shape
    if gate.shape != (n, heads * size) or weight.shape != (size,):
        raise ValueError(
            f"gate must be [{n}, {heads * size}] and weight [{size}], got {tuple(gate.shape)}, {tuple(weight.shape)}"
        )
    if not x.is_contiguous() or gate.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x and weight must be contiguous, gate contiguous along its last dim")
    out = torch.empty(n, heads * size, dtype=gate.dtype, device=gate.device)  # out: [N, H * D]
    block = triton.next_power_of_2(size)
    # heads a program: up to 4 and 2,048 values (one head a program, 128 values on 128 threads, spent more time
    # starting programs than normalising)
    group = min(4, triton.next_power_of_2(heads), max(1, 2048 // block))
    grid = n, triton.cdiv(heads, group)
    _gated_rmsnorm_kernel[grid](
        x,
        gate,
        weight,
        out,
        gate_row_stride=gate.stride(0),
        heads=heads,
        eps=eps,
        SIZE=size,
        BLOCK=block,
        HEADS=group,
        **dependent(x.device),
    )
    return out
