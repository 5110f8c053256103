"""Triton versions of the slot store's work: gather a bucket's inputs by slot, advance, scatter sampler state."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from executor_svc.attention import StepInputs
from protos.layout import RowLayout

_ROWS_PER_PROGRAM = 128  # bucket rows per program of gather/advance (buckets go up to 256)


@triton.jit
def _gather_inputs_kernel(
    rows_ptr,
    slots_ptr,
    last_token_ptr,
    tokens_ptr,
    positions_ptr,
    kv_lens_ptr,
    write_page_ptr,
    write_offset_ptr,
    batch,
    columns,
    block_table_col,
    span,
    last_position,
    KV_LEN: tl.constexpr,
    POS_OFFSET: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = index < batch
    slot = tl.load(slots_ptr + index, mask=live, other=0).to(tl.int64)
    row = rows_ptr + slot * columns
    kv_len = tl.load(row + KV_LEN, mask=live, other=0)
    pos_offset = tl.load(row + POS_OFFSET, mask=live, other=0)
    page_index = kv_len // PAGE
    # A row already at its span's end (the planner never sends one) writes to the sink page, not past the row.
    page = tl.load(row + block_table_col + page_index, mask=live & (page_index < span), other=0)
    tl.store(tokens_ptr + index, tl.load(last_token_ptr + slot, mask=live, other=0).to(tl.int64), mask=live)
    # Past the context (a bad row, or steady steps run too long) the position stays at the tables' last.
    position = tl.minimum(kv_len.to(tl.int64) + pos_offset.to(tl.int64), last_position)
    tl.store(positions_ptr + index, position, mask=live)
    tl.store(kv_lens_ptr + index, kv_len, mask=live)
    tl.store(write_page_ptr + index, page, mask=live)
    tl.store(write_offset_ptr + index, kv_len % PAGE, mask=live)


@triton.jit
def _advance_kernel(rows_ptr, slots_ptr, batch, columns, KV_LEN: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = index < batch
    slot = tl.load(slots_ptr + index, mask=live, other=0).to(tl.int64)
    real = live & (slot != 0)
    # Real slots of a bucket are distinct (the runner checks), so a plain read-modify-write is safe.
    length = rows_ptr + slot * columns + KV_LEN
    tl.store(length, tl.load(length, mask=real, other=0) + 1, mask=real)


@triton.jit(do_not_specialize=["count"])  # it varies step to step: one compile serves all
def _scatter_sampler_kernel(
    words_ptr,
    count,
    slots,
    temperature_ptr,
    top_p_ptr,
    top_k_ptr,
    seed_ptr,
    last_token_ptr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = index < count
    slot = tl.load(words_ptr + index, mask=live, other=0).to(tl.int64)
    # The host checks every slot; this keeps a bad one off the sink and off memory past the state.
    live = live & (slot > 0) & (slot < slots)
    f32 = words_ptr + count + index * 2  # (temperature, top_p) bits per slot
    i32 = words_ptr + 3 * count + index * 4  # (top_k, seed_lo, seed_hi, last_token) per slot
    tl.store(temperature_ptr + slot, tl.load(f32, mask=live, other=0).to(tl.float32, bitcast=True), mask=live)
    tl.store(top_p_ptr + slot, tl.load(f32 + 1, mask=live, other=0).to(tl.float32, bitcast=True), mask=live)
    tl.store(top_k_ptr + slot, tl.load(i32, mask=live, other=0), mask=live)
    seed_lo = tl.load(i32 + 1, mask=live, other=0).to(tl.uint32).to(tl.int64)  # zero-extended
    seed_hi = tl.load(i32 + 2, mask=live, other=0).to(tl.int64)
    tl.store(seed_ptr + slot, (seed_hi << 32) | seed_lo, mask=live)
    last = tl.load(i32 + 3, mask=live, other=0)
    tl.store(last_token_ptr + slot, last.to(tl.int64), mask=live & (last >= 0))


class SamplerState(NamedTuple):
    temperature: torch.Tensor  # f32[S]
    top_p: torch.Tensor  # f32[S]
    top_k: torch.Tensor  # i32[S]
    seed: torch.Tensor  # i64[S]
    last_token: torch.Tensor  # i64[S]


def scatter_sampler(words: torch.Tensor, count: int, state: SamplerState) -> None:
    """Write the sampler state of `count` slots from staged words int32: the slots, then (temperature, top_p)
    as float32 bits per slot, then (top_k, seed_lo, seed_hi, last_token) per slot (SlotStore.write_sampler's
    layout). The seed is the uint64 of its two halves; last_token < 0 keeps the slot's loop-back token.

    One launch where the torch version is a dozen indexed writes (~0.3 ms of host on a GPU). A count of
    zero runs one program that writes nothing (the warm-up compile).
    """
    if words.dtype != torch.int32 or words.numel() < 7 * count:
        raise ValueError(f"words must be int32[>= {7 * count}], got {words.dtype}[{words.numel()}]")
    grid = (triton.cdiv(max(count, 1), _ROWS_PER_PROGRAM),)
    _scatter_sampler_kernel[grid](words, count, state.temperature.shape[0], *state, BLOCK=_ROWS_PER_PROGRAM)


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dtype != torch.int32 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int32[S, C], got {rows.dtype} {tuple(rows.shape)}")


def gather_inputs(
    rows: torch.Tensor,
    step_slots: torch.Tensor,
    last_token: torch.Tensor,
    page_size: int,
    max_seq_len: int,
    block_table_col: int = RowLayout.BLOCK_TABLE,
) -> StepInputs:
    """The decode inputs of the rows of step_slots[B] (i64 or i32; 0 = padding, which reads the sink row).

    last_token: i64[S], the loop-back buffer. The K/V write goes to block-table cell kv_len // page_size.
    Positions are clamped below max_seq_len (the rope tables' length).
    """
    _check_rows(rows)
    batch = step_slots.shape[0]
    device = rows.device
    inputs = StepInputs(
        tokens=torch.empty(batch, dtype=torch.int64, device=device),
        positions=torch.empty(batch, dtype=torch.int64, device=device),
        kv_lens=torch.empty(batch, dtype=torch.int32, device=device),
        write_page=torch.empty(batch, dtype=torch.int32, device=device),
        write_offset=torch.empty(batch, dtype=torch.int32, device=device),
    )
    columns = rows.shape[1]
    grid = (triton.cdiv(batch, _ROWS_PER_PROGRAM),)
    _gather_inputs_kernel[grid](
        rows,
        step_slots,
        last_token,
        inputs.tokens,
        inputs.positions,
        inputs.kv_lens,
        inputs.write_page,
        inputs.write_offset,
        batch,
        columns,
        block_table_col,
        columns - block_table_col,
        max_seq_len - 1,
        KV_LEN=RowLayout.KV_LEN,
        POS_OFFSET=RowLayout.POS_OFFSET,
        PAGE=page_size,
        BLOCK=_ROWS_PER_PROGRAM,
    )
    return inputs


def advance(rows: torch.Tensor, step_slots: torch.Tensor) -> None:
    """KV_LEN += 1 for each real row of step_slots[B]; padding rows (slot 0) add nothing."""
    _check_rows(rows)
    batch = step_slots.shape[0]
    grid = (triton.cdiv(batch, _ROWS_PER_PROGRAM),)
    _advance_kernel[grid](
        rows, step_slots, batch, rows.shape[1], KV_LEN=RowLayout.KV_LEN, BLOCK=_ROWS_PER_PROGRAM
    )
