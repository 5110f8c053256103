"""Plain torch paged attention: gathers each row's pages through its block table (the CPU reference)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from executor_svc.prefill_batch import PrefillBatch


def decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    attn_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row over its first attn_lens[b] positions: q[B, H, D] -> [B, H, D].

    k_layer, v_layer: [pages, page_size, kv_heads, head_dim]; block_tables: int32[B, W]; attn_lens: int32[B].
    """
    batch, _, head_dim = q.shape
    page_size, kv_heads = k_layer.shape[1], k_layer.shape[2]
    if q.device.type == "cpu":
        # On the CPU reading attn_lens.max() costs no device sync, and gathering only the pages the
        # longest row needs saves most of the work; on a GPU the width stays fixed for graph capture.
        pages_needed = max(1, -(-int(attn_lens.max()) // page_size))
        block_tables = block_tables[:, :pages_needed]
    width = block_tables.shape[1] * page_size
    # index_select on int64 is the fastest gather of whole pages on the CPU (several times `k_layer[table]`).
    flat_pages = block_tables.flatten().long()
    # k, v: [B, kv_heads, width, head_dim]
    k = k_layer.index_select(0, flat_pages).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    v = v_layer.index_select(0, flat_pages).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    # visible: [B, 1, 1, width]; every row sees at least position 0, so no row is all masked
    visible = torch.arange(width, device=q.device)[None, :] < attn_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


def prefill_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    pages: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of queries at positions [start, start+n) over [0, position]: q[n, H, D] -> [n, H, D].

    pages: int32[p], the sequence's pages in order, holding K/V of positions [0, start+n) already.
    """
    n, _, head_dim = q.shape
    kv_heads = k_layer.shape[2]
    total = start + n
    # k, v: [kv_heads, total, head_dim]
    pages = pages.long()
    k = k_layer.index_select(0, pages).view(-1, kv_heads, head_dim)[:total].transpose(0, 1)
    v = v_layer.index_select(0, pages).view(-1, kv_heads, head_dim)[:total].transpose(0, 1)
    # visible: [n, total]; query i sits at position start + i
    visible = (
        torch.arange(total, device=q.device)[None, :] <= torch.arange(start, total, device=q.device)[:, None]
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=visible, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def prefill_attention_batch(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch, scale: float
) -> torch.Tensor:
    """`prefill_attention` chunk by chunk over a packed batch: q[T, H, D] -> [T, H, D] (the CPU path; the
    Triton kernel does the batch in one launch)."""
    outs = []
    for i, (start, length, count) in enumerate(zip(batch.starts, batch.lengths, batch.page_counts)):
        first = int(batch.seq_starts_host[i])
        pages = batch.block_tables[i, : int(count)]
        outs.append(
            prefill_attention(q[first : first + int(length)], k_layer, v_layer, pages, int(start), scale)
        )
    return torch.cat(outs)
