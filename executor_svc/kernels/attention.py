"""Paged decode attention that reads each row's length and block table off the slot-store rows, by slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting
from executor_svc.kernels.dependent import await_inputs, dependent
from protos.layout import RowLayout

LOG2E = 1.4426950408889634
# tokens per inner step: several pages in flight when pages are small, fewer where wide heads are split (H100,
# Qwen3.5's 256-dim heads, 640 tokens a row: 32 tokens 14.5 us a layer against 64's 17.2 at 16 rows in 8
# partitions, 36.9 against 38.9 at 64 rows in 2; unsplit at 256 rows 141.5 against 124.7)
_MIN_TOKENS = 64
_WIDE_HEAD_TOKENS, _WIDE_HEAD_DIM = 32, 256
_MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows, so the query heads of a KV head are padded to 16
# the combine is in the kernel: one inner step (of 64 tokens) per partition is the fastest (H200); a split
# 256-dim head's partition, of 32-token steps, is two
_MIN_BLOCKS_PER_SPLIT = 1
_MAX_SPLITS = 64
_COMBINE_ELEMENTS = 8192  # partial outputs the combining program holds at once (64 a thread at 4 warps)


def _tokens_per_step(page_size: int, head_dim: int, splits: int) -> int:
    wide_split = head_dim >= _WIDE_HEAD_DIM and splits > 1
    return max(_WIDE_HEAD_TOKENS if wide_split else _MIN_TOKENS, page_size)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    rows_ptr,
    slots_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_oh,
    columns,
    block_table_col,
    span,
    qk_scale,
    KV_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """One program per (row, KV head, split): the KV head's GROUP query heads at once, online softmax. With
    splits, the last partition of a (row, KV head) to finish combines them all."""
    await_inputs(DEPENDENT)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    table = rows_ptr + slot * columns
    # The token just written counts; never past the span (a row the planner would not send).
    length = tl.minimum(tl.load(table + KV_LEN) + 1, span * PAGE)
    n_blocks = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(n_blocks, SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, n_blocks)

    g = tl.arange(0, GROUP_ROWS)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    real_head = g < GROUP
    # q: [GROUP_ROWS, HEAD_DIM], padding heads zero
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=real_head[:, None], other=0.0
    )
    if DOT_IN_F32:
        q = q.to(tl.float32)
    # running max and sum of exp2(score - max) per head: the online softmax
    top = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    for block in range(first, last):
        tokens = block * BLOCK_N + n
        live = tokens < length
        pages = tl.load(table + block_table_col + tokens // PAGE, mask=live, other=0).to(tl.int64)
        within = (tokens % PAGE).to(tl.int64)
        # k, v: [BLOCK_N, HEAD_DIM]
        k = tl.load(
            k_ptr
            + pages[:, None] * stride_kp
            + within[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=live[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + pages[:, None] * stride_vp
            + within[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=live[:, None],
            other=0.0,
        )
        if DOT_IN_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # scores: [GROUP_ROWS, BLOCK_N] in log2 units; every block in range holds a live token, so top is finite
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.exp2(top - new_top)
        p = tl.exp2(scores - new_top[:, None])
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        top = new_top

    if SPLITS == 1:
        out = acc / total[:, None]
        out_at = out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real_head[:, None])
    else:
        # An empty partition (a short row) stores lse -inf and zeros: it weighs nothing in the combine.
        filled = total > 0
        safe_total = tl.where(filled, total, 1.0)
        lse = tl.where(filled, top + tl.log2(safe_total), float("-inf"))
        first_part = (row * tl.num_programs(1) * GROUP + heads) * SPLITS
        tl.store(part_lse_ptr + first_part + split, lse, mask=real_head)
        tl.store(
            part_out_ptr + (first_part + split)[:, None] * HEAD_DIM + d[None, :],
            acc / safe_total[:, None],
            mask=real_head[:, None],
        )
        # Release our partition, and learn whether it was the last (acquire the others'): no second kernel.
        counter = counters_ptr + row * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            # the real heads only, SPLIT_BLOCK partitions a load: each load in flight at once, not one a partition
            h = tl.arange(0, GROUP_POW2)
            live_h = h < GROUP
            s = tl.arange(0, SPLIT_BLOCK)
            parts = (row * tl.num_programs(1) * GROUP + kv_head * GROUP + h) * SPLITS
            # lses: [GROUP_POW2, SPLITS_POW2]; read past L1, which may hold none of the others' writes
            all_splits = tl.arange(0, SPLITS_POW2)
            lses = tl.load(
                part_lse_ptr + parts[:, None] + all_splits[None, :],
                mask=live_h[:, None] & (all_splits < SPLITS)[None, :],
                other=float("-inf"),
                cache_modifier=".cg",
            )
            # Partition 0 always holds the row's first block, so a real head's top is finite.
            peak = tl.where(live_h, tl.max(lses, 1), 0.0)
            mass = tl.sum(tl.exp2(lses - peak[:, None]), 1)
            combined = tl.zeros([GROUP_POW2, HEAD_DIM], tl.float32)
            for first_split in tl.static_range(0, SPLITS, SPLIT_BLOCK):
                held = live_h[:, None] & (first_split + s < SPLITS)[None, :]
                at = parts[:, None] + first_split + s[None, :]  # [GROUP_POW2, SPLIT_BLOCK]
                weight = tl.exp2(
                    tl.load(part_lse_ptr + at, mask=held, other=float("-inf"), cache_modifier=".cg")
                    - peak[:, None]
                )
                # partial: [GROUP_POW2, SPLIT_BLOCK, HEAD_DIM]
                partial = tl.load(
                    part_out_ptr + at[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=held[:, :, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                combined += tl.sum(weight[:, :, None] * partial, 1)
            combined = combined / tl.where(live_h, mass, 1.0)[:, None]
            combined_at = out_ptr + row * stride_ob + (kv_head * GROUP + h)[:, None] * stride_oh + d[None, :]
            tl.store(combined_at, combined.to(out_ptr.dtype.element_ty), mask=live_h[:, None])
            tl.store(counter, 0)  # rearmed for the next layer's launch


def _split_block(splits: int, group: int, head_dim: int) -> int:
    """Partitions the combine loads at once: all of them where their outputs fit ~64 floats a thread."""
    fit = max(1, _COMBINE_ELEMENTS // (triton.next_power_of_2(group) * head_dim))
    return min(triton.next_power_of_2(splits), triton.next_power_of_2(fit + 1) // 2)


def check_paged_qkv(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> None:
    """What every paged attention kernel here needs of q [N, H, D] and the pool layers [pages, page, KVH, D]:
    fitting heads (GQA), one dtype, contiguous head dims."""
    _, heads, head_dim = q.shape
    _, _, kv_heads, kv_dim = k_layer.shape
    if v_layer.shape != k_layer.shape or kv_dim != head_dim or heads % kv_heads:
        raise ValueError(
            f"q [N, {heads}, {head_dim}] does not fit k {tuple(k_layer.shape)}, v {tuple(v_layer.shape)}"
        )
    if not q.dtype == k_layer.dtype == v_layer.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k_layer.dtype}, {v_layer.dtype}")
    if q.stride(2) != 1 or k_layer.stride(3) != 1 or v_layer.stride(3) != 1:
        raise ValueError("q, k and v must be contiguous along head_dim")


def paged_strides(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides every paged attention kernel here takes, in its order: q's token and head, each pool layer's
    page, slot in page and KV head, out's token and head (head_dim is contiguous everywhere)."""
    return (*q.stride()[:2], *k_layer.stride()[:3], *v_layer.stride()[:3], *out.stride()[:2])


def decode_splits(batch: int, kv_heads: int, max_seq_len: int, page_size: int, sm_count: int) -> int:
    """Split-K partitions for a captured bucket: 1 when the (row, KV head) programs already fill the
    GPU, else enough to fill about two waves, each partition at least a few inner steps long."""
    programs = batch * kv_heads
    by_occupancy = (2 * sm_count) // programs
    by_length = max_seq_len // (_MIN_BLOCKS_PER_SPLIT * max(_MIN_TOKENS, page_size))
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    rows: torch.Tensor,
    step_slots: torch.Tensor,
    block_table_col: int,
    page_size: int,
    scale: float,
    splits: int = 1,
    counters: torch.Tensor | None = None,
    launch: tuple[int, int, int | None, int | None] | None = None,
) -> torch.Tensor:
    """One query per row over its KV_LEN + 1 positions: q[B, H, D] -> [B, H, D] in q's dtype.

    k_layer, v_layer: [pages, page_size, kv_heads, D]; rows: int32[S, C]; step_slots: [B] (0 = padding,
    which attends over position 0 of the sink page). Lengths and pages are read on the device by slot;
    `splits` > 1 partitions each row's pages (flash-decoding), the last partition of each row and KV head
    combining them. `counters`: int32[>= B * kv_heads], zero, which the kernel leaves zero again (pass a
    persistent one where the call is captured, so the graph sets nothing up); None: a fresh one. `launch`:
    (tokens an inner step, warps, register cap or None, pipeline stages or None) to time other launches
    (bench/decode_attention.py); None: max(64, page_size) tokens (32 for split heads of 256 dims and more) on
    4 warps, uncapped, Triton's default stages.
    """
    check_paged_qkv(q, k_layer, v_layer)
    batch, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_layer.shape
    if page != page_size:
        raise ValueError(f"k, v layers must be [pages, {page_size}, kv_heads, D], got {tuple(k_layer.shape)}")
    if head_dim & (head_dim - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim and page_size must be powers of two, got {head_dim}, {page_size}")
    if rows.dtype != torch.int32 or not rows.is_contiguous() or step_slots.shape != (batch,):
        raise ValueError(
            f"rows must be a contiguous int32[S, C] and step_slots [{batch}], got {rows.dtype}, "
            f"{tuple(step_slots.shape)}"
        )
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if counters is None:
        counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=q.device)
    if counters.dtype != torch.int32 or counters.numel() < batch * kv_heads:
        raise ValueError(
            f"counters must be int32[>= {batch * kv_heads}], got {counters.dtype}[{counters.numel()}]"
        )
    group = heads // kv_heads
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        part_out = part_lse = out  # unused by the kernel when SPLITS == 1
    else:
        part_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    columns = rows.shape[1]
    tokens, warps, registers, stages = (
        (_tokens_per_step(page_size, head_dim, splits), 4, None, None) if launch is None else launch
    )
    if tokens < max(16, page_size) or tokens & (tokens - 1):
        raise ValueError(
            f"tokens an inner step must be a power of two of at least a page and 16 (tl.dot), got {tokens}"
        )
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q,
        k_layer,
        v_layer,
        rows,
        step_slots,
        out,
        part_out,
        part_lse,
        counters,
        *paged_strides(q, k_layer, v_layer, out),
        columns,
        block_table_col,
        columns - block_table_col,
        scale * LOG2E,
        KV_LEN=RowLayout.KV_LEN,
        GROUP=group,
        GROUP_ROWS=max(_MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=page_size,
        BLOCK_N=tokens,
        SPLITS=splits,
        SPLITS_POW2=triton.next_power_of_2(splits),
        SPLIT_BLOCK=_split_block(splits, group, head_dim),
        GROUP_POW2=triton.next_power_of_2(group),
        # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584).
        DOT_IN_F32=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=warps,
        **({} if registers is None else {"maxnreg": registers}),
        **({} if stages is None else {"num_stages": stages}),
        **dependent(q.device),
    )
    return out
