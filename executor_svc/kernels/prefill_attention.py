"""Causal paged attention for a packed prefill batch: every chunk of the step in one launch per layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting
from executor_svc.kernels.attention import LOG2E, check_paged_qkv, paged_strides
from executor_svc.prefill.batch import QUERY_BLOCK, PrefillBatch

BLOCK_M = QUERY_BLOCK  # queries of one chunk per program (the batch lays out the blocks)
# (key positions an inner step, warps, pipeline stages) by head size. At 256 dims the first choice (64, 4, 3)
# spilled 440 bytes a thread on sm90; 32 keys in two stages took 0.69x its time on an H100
# (bench/prefill_kernels.py). Smaller heads keep it, unmeasured.
_WIDE_HEAD_TILES, _TILES = (32, 4, 2), (64, 4, 3)


@triton.jit(do_not_specialize=["table_width"])  # it varies step to step: one compile serves all
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_chunk_ptr,
    block_first_ptr,
    seq_starts_ptr,
    kv_lens_ptr,
    tables_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    table_width,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
):
    """One program per (query block, head): BLOCK_M queries of one chunk against positions [0, their own]."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    chunk = tl.load(block_chunk_ptr + block)
    first = tl.load(block_first_ptr + block)  # token index in the batch of the block's first query
    chunk_begin = tl.load(seq_starts_ptr + chunk)
    chunk_end = tl.load(seq_starts_ptr + chunk + 1)
    kv_len = tl.load(kv_lens_ptr + chunk)
    start = kv_len - (chunk_end - chunk_begin)  # position of the chunk's first token
    table = tables_ptr + chunk * table_width

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_BLOCK)
    live_d = d < HEAD_DIM  # tl.dot needs at least 16: smaller heads are zero-padded
    n = tl.arange(0, BLOCK_N)
    tokens = first + m
    live_q = tokens < chunk_end
    q_pos = start + (tokens - chunk_begin)
    # q: [BLOCK_M, DIM_BLOCK]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=live_q[:, None] & live_d[None, :],
        other=0.0,
    )
    if DOT_IN_F32:
        q = q.to(tl.float32)
    # Keys past the block's last query are masked for every query of it: stop there.
    seen = tl.minimum(kv_len, start + (first - chunk_begin) + BLOCK_M)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_BLOCK], tl.float32)
    for key_first in range(0, seen, BLOCK_N):
        keys = key_first + n
        live_k = keys < seen
        pages = tl.load(table + keys // PAGE, mask=live_k, other=0)
        within = keys % PAGE
        # k, v: [BLOCK_N, DIM_BLOCK]
        k = tl.load(
            k_ptr
            + pages[:, None] * stride_kp
            + within[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=live_k[:, None] & live_d[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + pages[:, None] * stride_vp
            + within[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=live_k[:, None] & live_d[None, :],
            other=0.0,
        )
        if DOT_IN_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # scores: [BLOCK_M, BLOCK_N] in log2 units; position 0 is in the first block and every query sees it,
        # so top is finite from the first step on
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = (keys[None, :] <= q_pos[:, None]) & live_k[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.exp2(top - new_top)
        p = tl.exp2(scores - new_top[:, None])
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        top = new_top
    out = acc / total[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live_q[:, None] & live_d[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    *,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of a packed batch: q[T, H, D] -> [T, H, D] in q's dtype. Chunk i's queries sit at
    positions [starts[i], kv_lens[i]) and see their chunk's pages up to themselves, K/V already written.

    k_layer, v_layer: [pages, page_size, kv_heads, D]. Padding tokens of a
    graph's batch (past its chunks) get zeros. `tiles` (key positions an inner step, warps, Triton's pipeline
    stages) overrides the launch's, chosen by head size.
    """
    check_paged_qkv(q, k_layer, v_layer)
    tokens, heads, head_dim = q.shape
    block_n, warps, stages = tiles or (_WIDE_HEAD_TILES if head_dim >= 256 else _TILES)
    if block_n not in (16, 32, 64, 128) or warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 4:
        raise ValueError(
            f"tiles must hold 16-128 keys (a power of two), 1-16 warps (a power of two) and 1-4 stages, got "
            f"{block_n}, {warps}, {stages}"
        )
    _, page_size, kv_heads, _ = k_layer.shape
    if tokens != batch.token_ids.shape[0]:
        raise ValueError(f"q holds {tokens} tokens, the batch {batch.token_ids.shape[0]}")
    # No query block covers the padding tokens: zeros keep their rows finite through the layers after.
    out = torch.zeros_like(q)
    _paged_prefill_kernel[(batch.block_chunk.shape[0], heads)](
        q,
        k_layer,
        v_layer,
        out,
        batch.block_chunk,
        batch.block_first,
        batch.seq_starts,
        batch.kv_lens,
        batch.block_tables,
        *paged_strides(q, k_layer, v_layer, out),
        batch.block_tables.shape[1],
        scale * LOG2E,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        DIM_BLOCK=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584).
        DOT_IN_F32=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return out
