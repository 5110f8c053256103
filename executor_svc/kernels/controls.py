"""The sampling controls' logit adjustment in one kernel: logit bias, the repetition, frequency and presence
penalties, the stop ids masked below min_tokens and the grammar's mask, each row reading its slot's tables.
The torch form (SamplerControls.apply's reference) takes ~30 launches over [B, V]; this one takes one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _adjust_kernel(
    logits_ptr,
    out_ptr,
    slots_ptr,
    on_ptr,
    bias_ptr,
    seen_ptr,
    counts_ptr,
    stop_ptr,
    grammar_ptr,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    generated_ptr,
    min_tokens_ptr,
    vocab,
    words,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < vocab
    slot = tl.load(slots_ptr + row).to(tl.int64)
    logits = tl.load(logits_ptr + row * vocab + cols, mask=live, other=0.0)
    table = slot * vocab + cols
    # The same operations in the same order as the torch reference, so the results are equal.
    adjusted = logits + tl.load(bias_ptr + table, mask=live, other=0.0)
    repetition = tl.load(repetition_ptr + slot)
    # div_rn: IEEE division as torch does it (Triton's "/" on float32 is an approximate one on CUDA)
    penalized = tl.where(adjusted > 0, tl.math.div_rn(adjusted, repetition), adjusted * repetition)
    adjusted = tl.where(tl.load(seen_ptr + table, mask=live, other=0) != 0, penalized, adjusted)
    counts = tl.load(counts_ptr + table, mask=live, other=0).to(tl.float32)
    adjusted = adjusted - tl.load(frequency_ptr + slot) * counts
    adjusted = adjusted - tl.load(presence_ptr + slot) * (counts > 0).to(tl.float32)
    early = tl.load(generated_ptr + slot) < tl.load(min_tokens_ptr + slot)
    stop = (tl.load(stop_ptr + table, mask=live, other=0) != 0) & early
    word = tl.load(grammar_ptr + slot * words + (cols >> 5), mask=live, other=-1)
    allowed = ((word >> (cols & 31)) & 1) != 0
    adjusted = tl.where(stop | ~allowed, float("-inf"), adjusted)
    on = tl.load(on_ptr + slot) != 0
    tl.store(out_ptr + row * vocab + cols, tl.where(on, adjusted, logits), mask=live)


def adjust_logits(
    logits: torch.Tensor,
    slots: torch.Tensor,
    on: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scalars: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """f32[B, V]: `logits` f32[B, V] adjusted by each row's slot's controls; `tables` bias, seen, counts, stop
    ([S, V]) and the grammar mask ([S, ceil(V/32)]); `scalars` repetition, frequency, presence, generated and
    min_tokens ([S]); rows whose slot is not `on` as they were."""
    batch, vocab = logits.shape
    logits = logits.contiguous()
    out = torch.empty_like(logits)  # out: [B, V]
    bias, seen, counts, stop, grammar = tables
    # No fused multiply-adds: torch rounds `frequency * counts` before subtracting it, and so must this.
    _adjust_kernel[(batch, triton.cdiv(vocab, _BLOCK))](
        logits,
        out,
        slots,
        on,
        bias,
        seen,
        counts,
        stop,
        grammar,
        *scalars,
        vocab,
        grammar.shape[1],
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _count_inputs_kernel(slots_ptr, tokens_ptr, on_ptr, counts_ptr, seen_ptr, generated_ptr, vocab):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if tl.load(on_ptr + slot) != 0:  # a step's rows hold distinct slots; its padding rows the sink, never on
        at = slot * vocab + tl.load(tokens_ptr + row).to(tl.int64)
        tl.store(counts_ptr + at, tl.load(counts_ptr + at) + 1)
        tl.store(seen_ptr + at, tl.full((), 1, tl.int1))
        tl.store(generated_ptr + slot, tl.load(generated_ptr + slot) + 1)


def count_inputs(
    slots: torch.Tensor,
    tokens: torch.Tensor,
    on: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    generated: torch.Tensor,
) -> None:
    """Each row's input token counted in its slot's `counts` and `seen` ([S, V]) and `generated` ([S]), for
    the rows whose slot is `on`: one launch (torch's three index_put_ took ~70 µs at 16 rows)."""
    _count_inputs_kernel[(slots.shape[0],)](slots, tokens, on, counts, seen, generated, counts.shape[1])


@triton.jit
def _logprob_partials_kernel(
    logits_ptr, top_ptr, top_ids_ptr, max_ptr, sum_ptr, vocab, blocks, K: tl.constexpr, BLOCK: tl.constexpr
):
    """One block of a row's vocabulary: its K best logits (best first, the lower id first among equals), its
    max and its sum of exp(x - max)."""
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * vocab + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    tl.store(max_ptr + row * blocks + block, best)
    shift = tl.where(best == float("-inf"), 0.0, best)  # a block all -inf sums to 0, not NaN
    tl.store(sum_ptr + row * blocks + block, tl.sum(tl.exp(x - shift), 0))
    out = (row * blocks + block) * K
    for i in tl.static_range(K):
        value = tl.max(x, 0)
        at = tl.min(tl.where(x == value, cols, 2147483647), 0)
        tl.store(top_ptr + out + i, value)
        tl.store(top_ids_ptr + out + i, at)
        x = tl.where(cols == at, float("-inf"), x)


@triton.jit
def _logprob_table_kernel(
    logits_ptr,
    tokens_ptr,
    top_ptr,
    top_ids_ptr,
    max_ptr,
    sum_ptr,
    table_ptr,
    vocab,
    blocks,
    K: tl.constexpr,
    CANDIDATES: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """A row's table from its blocks' partials: the chosen token's logprob, the K best, their ids."""
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    maxes = tl.load(max_ptr + row * blocks + b, mask=b < blocks, other=float("-inf"))
    best = tl.max(maxes, 0)
    sums = tl.load(sum_ptr + row * blocks + b, mask=b < blocks, other=0.0)
    lse = best + tl.log(tl.sum(sums * tl.exp(maxes - best), 0))
    token = tl.load(tokens_ptr + row).to(tl.int64)
    table = table_ptr + row * (1 + 2 * K)
    tl.store(table, tl.load(logits_ptr + row * vocab + token).to(tl.float32) - lse)
    c = tl.arange(0, CANDIDATES)
    live = c < blocks * K
    values = tl.load(top_ptr + row * blocks * K + c, mask=live, other=float("-inf"))
    ids = tl.load(top_ids_ptr + row * blocks * K + c, mask=live, other=2147483647)
    for i in tl.static_range(K):
        value = tl.max(values, 0)
        at = tl.min(tl.where(values == value, ids, 2147483647), 0)
        tl.store(table + 1 + i, value - lse)
        tl.store(table + 1 + K + i, tl.where(value > float("-inf"), at, 0).to(tl.float32))
        values = tl.where(ids == at, float("-inf"), values)


def fused_logprob_table(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logprob_table's (sampler_controls) f32[B, 1 + 2k] in two launches: each vocabulary block's k best and
    its log-sum-exp parts, then each row's merge (torch's log_softmax + topk + gather + cat: ~80 µs at 16 rows
    on an H200)."""
    batch, vocab = logits.shape
    blocks = triton.cdiv(vocab, _BLOCK)
    device = logits.device
    top = torch.empty(batch, blocks, k, dtype=torch.float32, device=device)  # top: [B, blocks, k]
    top_ids = torch.empty(batch, blocks, k, dtype=torch.int32, device=device)
    maxes = torch.empty(batch, blocks, dtype=torch.float32, device=device)
    sums = torch.empty(batch, blocks, dtype=torch.float32, device=device)
    table = torch.empty(batch, 1 + 2 * k, dtype=torch.float32, device=device)
    logits = logits.contiguous()
    _logprob_partials_kernel[(batch, blocks)](
        logits, top, top_ids, maxes, sums, vocab, blocks, K=k, BLOCK=_BLOCK
    )
    _logprob_table_kernel[(batch,)](
        logits,
        tokens,
        top,
        top_ids,
        maxes,
        sums,
        table,
        vocab,
        blocks,
        K=k,
        CANDIDATES=triton.next_power_of_2(blocks * k),
        BLOCKS=triton.next_power_of_2(blocks),
    )
    return table
