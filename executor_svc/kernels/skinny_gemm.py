"""Projections of a middling decode bucket (more rows than the GEMV takes, at most 64) as one Triton kernel:
x[M, K] @ weight[N, K].T on the tensor cores, one block of rows covering all M so every weight value is read
once, and the K dimension split between programs so even a 1,024-wide projection fills the GPU. The splits
meet inside the same kernel: each stores its float32 partial sum, and the last of a column block's splits to
arrive (an atomic counter) adds them in split order, so the result does not depend on which arrives last and
a CUDA graph holds one kernel a projection, no reduction launch. Or (skinny_sums) the splits' sums are left
for the kernel that reads the product to add up the same way (fused.rmsnorm_residual), and the kernel ends
without the counter."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting
from executor_svc.kernels.dependent import LINE, await_inputs, dependent, prefetch_l2

MIN_ROWS, MAX_ROWS = 5, 64  # below: the GEMV (gemv.MAX_ROWS); above: one row block would no longer cover M
_COUNTERS = 8192  # column blocks a split projection may have (Qwen3.5-0.8B's widest: 8,224 / 32 = 257)
_NARROWEST_MEASURED = 1024  # the narrowest output wins() was measured at
_TARGET_PROGRAMS = 128  # about one an SM on the H200's 132: two were slower (5.9 against 5.6 us at 32 rows)


class SkinnyConfig(NamedTuple):
    """A launch: column block, K chunk, K splits, warps and pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


# The wide projections it takes (wins()): outputs at least 7 times an input of at most 1,024, at 16 rows or more
_WIDE_RATIO, _WIDE_WIDEST_INPUT, _WIDE_FEWEST_ROWS = 7, 1024, 16
# their launch: 64-wide column blocks (a 32-wide block re-reads x from L2 at twice its weights' bytes), each
# program all of K, four stages deep
_WIDE_CONFIG = SkinnyConfig(block_n=64, block_k=128, split_k=1, warps=4, stages=4)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    rows,
    n_out,
    k_in,
    stride_x,
    stride_out,
    k_per_split,
    SPLIT_K: tl.constexpr,
    SUMS_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * weight[n, k] for outputs [pid0 * BLOCK_N, +BLOCK_N), every row m, over the
    K range [pid1 * k_per_split, +k_per_split); with SPLIT_K > 1, the partial goes to partial[pid1] and the
    column block's last split sums partial[0..SPLIT_K) in order into out and resets its counter. SUMS_ONLY: each
    split's partial goes to partial[pid1] and the kernel ends there, the sum left to the kernel that reads it."""
    column_block, split = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m = m < rows
    live_n = n < n_out
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_in)
    if (
        DEPENDENT
    ):  # this program's weights into L2 while the kernel before drains, 8 lines a weight row at a time
        weight_rows = tl.minimum(n, n_out - 1).to(tl.int64)[:, None] * k_in
        lines = tl.arange(0, 8) * LINE_ELEMENTS
        for k0 in range(k_start, k_end, 8 * LINE_ELEMENTS):
            prefetch_l2(weight_ptr + weight_rows + tl.minimum(k0 + lines, k_end - 1)[None, :])
    await_inputs(DEPENDENT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        live_k = k < k_end
        # x: [BLOCK_M, BLOCK_K]; w: [BLOCK_K, BLOCK_N], weight's rows as columns
        x = tl.load(
            x_ptr + m[:, None] * stride_x + k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0
        )
        w = tl.load(
            weight_ptr + n[None, :] * k_in + k[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0
        )
        if DOT_IN_F32:  # the CPU interpreter's dot misreads bfloat16 (stored as uint16)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee": float32 inputs stay float32 (no tf32), as F.linear's; 16-bit inputs multiply exactly anyway
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tile = live_m[:, None] & live_n[None, :]
    out_ptrs = out_ptr + m[:, None] * stride_out + n[None, :]
    partial_tile = m[:, None] * n_out + n[None, :]
    split_stride = rows * n_out
    if SUMS_ONLY:
        tl.store(partial_ptr + split * split_stride + partial_tile, acc, mask=tile)
    elif SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile)
    else:
        tl.store(partial_ptr + split * split_stride + partial_tile, acc, mask=tile)
        # every thread's store is made before the release: the barrier orders them before the atomic
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + column_block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: past this SM's L1, not coherent, where the other splits' stores may be missing
                total += tl.load(
                    partial_ptr + s * split_stride + partial_tile, mask=tile, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=tile)
            tl.atomic_xchg(counter_ptr + column_block, 0, sem="relaxed", scope="gpu")


_counters: dict[torch.device, torch.Tensor] = {}


def _counters_on(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, zero between kernels (each split projection resets its own). One set a
    device: the projections that use them run one after another on the step's stream."""
    if device not in _counters:
        _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def block_m(rows: int) -> int:
    """The row block: tl.dot takes at least 16."""
    return max(16, triton.next_power_of_2(rows))


def default_config(rows: int, n_out: int, k_in: int, dtype: torch.dtype) -> SkinnyConfig:
    """The launch for a projection (chosen by bench/skinny_gemm_vs_cublas.py --sweep at Qwen3.5-0.8B's shapes):
    a narrow one (on the H200, 8 to 64 rows), 32-wide column blocks, K in chunks of 256, split until there is
    about a program an SM, each split with at least two chunks; a wide one (on an H100, 16 to 64 rows),
    _WIDE_CONFIG."""
    if dtype != torch.float32 and _wide(n_out, k_in):
        return _WIDE_CONFIG
    block_n = 32
    block_k = 256 if dtype != torch.float32 else 64  # float32's pipeline fits shared memory at 64
    chunks = triton.cdiv(k_in, block_k)
    columns = triton.cdiv(n_out, block_n)
    split_k = 1
    while columns * split_k < _TARGET_PROGRAMS and chunks >= 4 * split_k and columns <= _COUNTERS:
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k, 4, 3)


def wins(rows: int, n_out: int, k_in: int, dtype: torch.dtype) -> bool:
    """Whether the kernel beats F.linear (cuBLAS) at a projection. On the H200 (bench/skinny_gemm_vs_cublas.py,
    Qwen3.5-0.8B's shape, bf16, us a projection, cuBLAS against this kernel): it wins where the output is
    narrower than the input, which cuBLAS splits along K and reduces in a second kernel (16 rows: 1,024 x 2,048
    5.9 against 5.1, 1,024 x 3,584 8.1 against 6.4; 64 rows: 8.3 against 7.2, 1,024 x 2,048 within 2%), and
    loses on the wide ones (up to 1.5x: 5,120 x 1,024 at 64 rows, 5.5 against 8.4); in float32 (tl.dot
    "ieee", no tensor cores) it lost at most shapes, up to 5x (one exception: 1,024 x 2,048 at 16 rows, 27.5
    against 23.2). Outputs narrower than 1,024 (SmolLM2's 576-wide down projection) were not measured and
    stay with cuBLAS. The widest projections win in 64-wide column blocks (on an H100, bf16, us, at 64 rows in
    _WIDE_CONFIG: 8,224 x 1,024 8.5 against 7.9, 7,168 x 1,024 7.7 against 7.3; at 16 rows, swept in K chunks of
    256, 8.3 against 7.8 and 7.6 against 6.9, where the launch keeps chunks of 128; Qwen3.5-0.8B's decode graph
    in _WIDE_CONFIG 1.5% shorter at 16 and 64 rows, unchanged at 32), unlike 5,120 x 1,024 (at 64 rows 6.5
    against 6.7); below 16 rows they were not measured."""
    narrow = _NARROWEST_MEASURED <= n_out < k_in
    wide = _wide(n_out, k_in) and rows >= _WIDE_FEWEST_ROWS
    return MIN_ROWS <= rows <= MAX_ROWS and dtype == torch.bfloat16 and (narrow or wide)


def _wide(n_out: int, k_in: int) -> bool:
    return n_out >= _WIDE_RATIO * k_in and k_in <= _WIDE_WIDEST_INPUT


class SplitSums(NamedTuple):
    """A projection's output as its K splits' float32 sums, left for the kernel that reads it to add up in split
    order and round to `dtype` (fused.rmsnorm_residual), as the skinny GEMM's last split would have."""

    sums: torch.Tensor  # [splits, M, N] float32
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The output [M, N] in `dtype`, the sums added in split order as the kernels add them."""
        total = self.sums[0]
        for split in self.sums[1:]:
            total = total + split
        return total.to(self.dtype)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x[M, K] @ weight[N, K].T -> out[M, N] in x's dtype (float32 accumulation), for M <= MAX_ROWS."""
    return _launch(x, weight, config, sums_only=False)[0]


def skinny_sums(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> SplitSums:
    """skinny_gemm's product as its splits' float32 sums, for a reader that adds them up itself: the kernel ends
    without the last split's wait on an atomic counter and its read-back of the others."""
    return SplitSums(_launch(x, weight, config, sums_only=True)[1], x.dtype)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None, sums_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch: (out, partial); where sums_only, partial holds the product and out is not written."""
    rows, k_in = x.shape
    n_out, weight_k = weight.shape
    if rows > MAX_ROWS or weight_k != k_in:
        raise ValueError(
            f"skinny_gemm takes x [M <= {MAX_ROWS}, K] and weight [N, K], "
            f"got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or not weight.is_contiguous() or x.dtype != weight.dtype:
        raise ValueError("x and weight must share a dtype, x contiguous along K and weight contiguous")
    config = config or default_config(rows, n_out, k_in, x.dtype)
    columns = triton.cdiv(n_out, config.block_n)
    counted = config.split_k > 1 and not sums_only
    if counted and columns > _COUNTERS:
        raise ValueError(f"a split projection has at most {_COUNTERS} column blocks, got {columns}")
    # partial: [split_k, M, N] float32 sums, each split's K range (unused with one split, unless sums_only)
    out = torch.empty(0 if sums_only else rows, n_out, dtype=x.dtype, device=x.device)
    split = config.split_k > 1 or sums_only
    partial = torch.empty(config.split_k, rows, n_out, device=x.device) if split else out
    counters = _counters_on(x.device) if counted else out
    k_per_split = triton.cdiv(triton.cdiv(k_in, config.split_k), config.block_k) * config.block_k
    _skinny_gemm_kernel[(columns, config.split_k)](
        x,
        weight,
        out,
        partial,
        counters,
        rows,
        n_out,
        k_in,
        x.stride(0),
        out.stride(0),
        k_per_split,
        SPLIT_K=config.split_k,
        SUMS_ONLY=sums_only,
        BLOCK_M=block_m(rows),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_IN_F32=x.dtype == torch.bfloat16 and interpreting(),
        LINE_ELEMENTS=LINE // x.element_size(),
        num_warps=config.warps,
        num_stages=config.stages,
        **dependent(x.device),
    )
    return out, partial
