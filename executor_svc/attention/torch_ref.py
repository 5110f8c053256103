"""Plain torch paged attention: gathers each row's pages through its block table (the reference the kernels
are checked against), and the CPU's decode step (which reads the pages in place through paged_cpu where it
can)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from executor_svc.attention import StepInputs, paged_cpu

if TYPE_CHECKING:
    from executor_svc.kv_pool import KVPool
    from executor_svc.plan import CheckedPlan
    from executor_svc.prefill.batch import PrefillBatch
    from executor_svc.slot_store import SlotStore


class DecodeGather(NamedTuple):
    """What every layer's decode attention of one step shares: which pages to read and what to mask."""

    flat_pages: torch.Tensor  # i64[B * W']: the block tables trimmed to the W' pages the longest row needs
    width: int  # W' * page_size positions per row
    mask: torch.Tensor  # f32[B, 1, 1, width]: 0 where visible, -inf past the row's length

    @staticmethod
    def build(
        block_tables: torch.Tensor, attn_lens: torch.Tensor, page_size: int, dtype: torch.dtype
    ) -> DecodeGather:
        """block_tables: int32[B, W]; attn_lens: int32[B] (each >= 1: position 0 is always visible)."""
        if block_tables.device.type == "cpu":
            # On the CPU reading attn_lens.max() costs no device sync, and gathering only the pages the
            # longest row needs saves most of the work; on a GPU the width stays fixed for graph capture.
            pages_needed = max(1, -(-int(attn_lens.max()) // page_size))
            block_tables = block_tables[:, :pages_needed]
        width = block_tables.shape[1] * page_size
        visible = torch.arange(width, device=block_tables.device)[None, :] < attn_lens[:, None]
        # An additive mask made once a step: SDPA would turn a boolean one into this in every layer.
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
            ~visible, -torch.inf
        )
        # index_select on int64 is the fastest gather of whole pages on the CPU (several times `k_layer[table]`).
        return DecodeGather(block_tables.flatten().long(), width, mask[:, None, None, :])


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
    gather = DecodeGather.build(block_tables, attn_lens, k_layer.shape[1], q.dtype)
    return gathered_decode_attention(q, k_layer, v_layer, gather, scale)


def gathered_decode_attention(
    q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, gather: DecodeGather, scale: float
) -> torch.Tensor:
    """decode_attention with the step's pages and mask worked out already: q[B, H, D] -> [B, H, D]."""
    batch, _, head_dim = q.shape
    kv_heads = k_layer.shape[2]
    # k, v: [B, kv_heads, width, head_dim]
    k = (
        k_layer.index_select(0, gather.flat_pages)
        .view(batch, gather.width, kv_heads, head_dim)
        .transpose(1, 2)
    )
    v = (
        v_layer.index_select(0, gather.flat_pages)
        .view(batch, gather.width, kv_heads, head_dim)
        .transpose(1, 2)
    )
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=gather.mask, scale=scale, enable_gqa=True
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
    n, heads, head_dim = q.shape
    kv_heads = k_layer.shape[2]
    total = start + n
    # k, v: [1, heads, total, head_dim], each KV head repeated for its query heads: 4-D inputs without
    # enable_gqa take torch's fused CPU kernel, half the time of the math path the others take (same values)
    pages = pages.long()
    k = k_layer.index_select(0, pages).view(-1, kv_heads, head_dim)[:total].transpose(0, 1)
    v = v_layer.index_select(0, pages).view(-1, kv_heads, head_dim)[:total].transpose(0, 1)
    k = k.repeat_interleave(heads // kv_heads, 0)[None]
    v = v.repeat_interleave(heads // kv_heads, 0)[None]
    # visible: [n, total]; query i sits at position start + i (a prompt from its start: plain causal)
    visible = None
    if start:
        visible = (
            torch.arange(total, device=q.device)[None, :]
            <= torch.arange(start, total, device=q.device)[:, None]
        )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=visible, is_causal=not start, scale=scale
    )
    return out[0].transpose(0, 1)


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


class TorchDecode:
    """The decode step in torch ops (the CPU path): each row's block table gathered off the slot store by
    slot. The attention reads the pages in place (paged_cpu.c) where the pool is float32 on the CPU and the
    kernel builds, else by `decode_attention`'s gathered copy. Nothing planned on the host."""

    fused = False
    kind = "torch"

    def __init__(self, store: SlotStore | None, kv: KVPool, scale: float, max_seq_len: int) -> None:
        self.store = store  # None: the inputs are given with `over` (the reference tests)
        self.kv = kv
        self.scale = scale
        self.max_seq_len = max_seq_len
        self.in_place = paged_cpu.serves(kv.k)
        # Set by `over` for the layers' attention of the same step, one of:
        self._gather: DecodeGather | None = None  # the step's pages and mask (the gathering path)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # block tables, lengths (in place)

    def plan(self, plan: CheckedPlan) -> None:
        pass

    def prepare(self, bucket: int) -> None:
        pass

    def inputs(self, bucket: int) -> StepInputs:
        assert self.store is not None, "TorchDecode without a slot store takes its inputs from `over`"
        rows = self.store.gather(bucket)
        return self.over(rows.tokens, rows.positions, rows.kv_lens, rows.block_tables)

    def over(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> StepInputs:
        """The inputs of rows given directly: tokens, positions i64[B], kv_lens i32[B] (stored before this
        step), block_tables i32[B, W]. The token's K/V goes to page block_tables[b, kv_lens[b] // P], offset
        kv_lens[b] % P, and the row attends over kv_lens[b] + 1 positions. Padding rows: token 0, length 0,
        block table of zeros (the sink page)."""
        page_size, span = self.kv.page_size, block_tables.shape[1]
        # A row past its span or the context (a bad row, or steady steps run too long: the planner never
        # sends one) writes to the sink page, reads its own span and stays at the tables' last position,
        # as the gather kernel does.
        page_index = (kv_lens // page_size).long()
        inside = page_index < span
        write_page = block_tables.gather(1, page_index.clamp(max=span - 1)[:, None])[:, 0]
        write_page = torch.where(inside, write_page, torch.zeros_like(write_page))
        positions = positions.clamp(max=self.max_seq_len - 1)
        # kv_lens + 1: the positions each row attends, its own included
        attn_lens = (kv_lens + 1).clamp(max=span * page_size).to(torch.int32)
        if self.in_place:
            self._tables = (block_tables.to(torch.int32).contiguous(), attn_lens)
        else:
            self._gather = DecodeGather.build(block_tables, attn_lens, page_size, self.kv.k.dtype)
        return StepInputs(tokens, positions, kv_lens, write_page, kv_lens % page_size)

    @property
    def paged(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's block tables int32[B, W] and attended lengths int32[B] where its attention reads the
        pages in place (the C decode step reads them too), else None."""
        return self._tables

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k_layer, v_layer = self.kv.k[layer], self.kv.v[layer]
        if self._tables is not None:
            tables, attn_lens = self._tables
            return paged_cpu.decode_attention(q, k_layer, v_layer, tables, attn_lens, self.scale)
        assert self._gather is not None, "over() sets the step's inputs before its layers run"
        return gathered_decode_attention(q, k_layer, v_layer, self._gather, self.scale)

    def stepped(self, bucket: int) -> None:
        pass
