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
