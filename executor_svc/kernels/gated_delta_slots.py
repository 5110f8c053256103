"""A gated delta net layer's decode step in Triton, reading and writing each row's conv window and recurrent
state in the state pool at its slot (as attention reads pages by slot): no gather of the states into a batch and
no scatter back. The contracts of gated_delta_ref's conv1d_step and delta_rule_step_at_slots, which stay the CPU
path; fixed shapes and no host sync, so a CUDA graph captures them.

The conv and the rule step each alone (the torch forward's rule on CUDA; the Triton-kernels forward's, wherever
gated_delta_joined.joined_step_wins is false), and the pieces its one-kernel step is made of."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.dependent import LINE, await_inputs, dependent, prefetch_l2

# Value dims per program: a [Dk, 8] float32 tile of the state on one warp (fla-core's and vLLM's choice for their
# fused recurrent kernel) below 128 rows of 16 heads (Qwen3.5-0.8B: 16 heads x 128 / 8 = 256 programs a row; on an
# H100 with value-major states, blocks of 8 against 16 and 32: 16.7 against 18.0 and 17.7 us a layer's three
# kernels at 16 rows, 29.4 / 30.8 / 30.4 at 32, 53.9 / 55.6 / 55.2 at 64), wider tiles once the batch fills the
# GPU (blocks of 16, 32 and 64 timed within 3% of each other at 64-256 rows).
_PROGRAMS_WANTED = 16384
_FLOATS_A_LINE = tl.constexpr(LINE // 4)  # float32 keys an L2 line holds


def value_block(rows: int, heads: int, dv: int, wanted: int = _PROGRAMS_WANTED) -> int:
    """The widest value block of 8, 16 or 32 that still gives `wanted` programs, else 8."""
    widest = min(32, triton.next_power_of_2(dv))
    for block in (32, 16):
        if block <= widest and rows * heads * triton.cdiv(dv, block) >= wanted:
            return block
    return min(8, widest)


@triton.jit
def decay_and_beta(g_at, b_at, decay_rate_ptr, dt_bias_ptr, head, RAW_GATES: tl.constexpr):
    """A row and head's decay exp(g) and beta, float32; RAW_GATES: from the projections a, b as the model
    computes them: beta = sigmoid(b) rounded to the dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32
    (softplus linear above 20, as torch's)."""
    g = tl.load(g_at).to(tl.float32)
    b = tl.load(b_at)
    if RAW_GATES:
        b = tl.sigmoid(b.to(tl.float32)).to(b_at.dtype.element_ty)
        g = g + tl.load(dt_bias_ptr + head)
        g = tl.load(decay_rate_ptr + head) * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    return tl.exp(g), b.to(tl.float32)


@triton.jit
def normed_qk(q, k, scale):
    """l2-normed q and k (eps inside the root, as fla and transformers), q scaled by Dk^-0.5."""
    return q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale, k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)


@triton.jit
def rule_tile(state, tile, written, q, k, v, decay, beta):
    """The rule's step on the state tile state [BK, BV] (float32, loaded from `tile` before the inputs, so its
    load overlaps theirs), stored back to `tile` where `written`: q, k [BK] normed, v [BV], decay and beta
    float32. Returns out [BV], float32."""
    state = state * decay
    remembered = tl.sum(state * k[:, None], axis=0)  # remembered: [BV], what the state says of k
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(tile, state, mask=written)
    return tl.sum(state * q[:, None], axis=0)


@triton.jit
def prefetch_state(
    states_ptr,
    slots_ptr,
    row,
    slot_count,
    head,
    values,
    HEADS: tl.constexpr,
    DV: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """Bring a program's state tile into L2 while the kernel before drains. The slot read here may be one the
    kernel before is still writing (before await_inputs: the one read of a kernel's output before the wait), so
    it only guesses the lines, clamped into the pool (as the values past DV of a last block are): a wrong guess
    costs a prefetch, never a value. Read past L1, so the slot read after the wait cannot find it cached."""
    if DEPENDENT:
        slot = tl.load(slots_ptr + row, cache_modifier=".cg").to(tl.int64)
        guess = tl.minimum(tl.maximum(slot, 0), slot_count - 1)
        lines = tl.arange(0, max(1, BK // _FLOATS_A_LINE)) * _FLOATS_A_LINE
        # one pointer a line of each value's DK keys: [lines, BV]
        prefetch_l2(
            states_ptr
            + ((guess * HEADS + head) * DV + tl.minimum(values, DV - 1)[None, :]) * DK
            + tl.minimum(lines, DK - 1)[:, None]
        )


@triton.jit
def _step_at_slots_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    decay_rate_ptr,
    dt_bias_ptr,
    states_ptr,
    slots_ptr,
    out_ptr,
    qk_row_stride,
    qk_head_stride,
    v_row_stride,
    v_head_stride,
    gate_row_stride,
    slot_count,
    scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    RAW_GATES: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    keys = tl.arange(0, BK)
    values = block * BV + tl.arange(0, BV)
    prefetch_state(states_ptr, slots_ptr, row, slot_count, head, values, HEADS, DV, DK, BK, DEPENDENT)
    await_inputs(DEPENDENT)
    key_live, value_live = keys < DK, values < DV
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # the state tile [BK, BV] of this row's slot and head, float32 (value-major in memory: BV runs of DK keys),
    # loaded first. A padding row reads the sink slot (zeros) and writes nothing back: slot 0 stays zero.
    tile = states_ptr + ((slot * HEADS + head) * DV + values[None, :]) * DK + keys[:, None]
    live = key_live[:, None] & value_live[None, :]
    state = tl.load(tile, mask=live, other=0.0)
    qk = row * qk_row_stride + (head // GROUP) * qk_head_stride + keys
    q = tl.load(q_ptr + qk, mask=key_live, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk, mask=key_live, other=0.0).to(tl.float32)
    q, k = normed_qk(q, k, scale)
    v = tl.load(v_ptr + row * v_row_stride + head * v_head_stride + values, mask=value_live, other=0.0)
    gates = row * gate_row_stride + head
    decay, beta = decay_and_beta(
        g_ptr + gates, beta_ptr + gates, decay_rate_ptr, dt_bias_ptr, head, RAW_GATES
    )
    # (the slot broadcast as an int first: Triton's interpreter refuses a scalar bool in a mask)
    written = live & (keys[:, None] * 0 + slot != 0)
    out = rule_tile(state, tile, written, q, k, v.to(tl.float32), decay, beta)
    tl.store(out_ptr + (row * HEADS + head) * DV + values, out, mask=value_live)


def delta_rule_step_at_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """One token of each of N sequences: q, k [N, Hk, Dk], v [N, H, Dv] (last dim contiguous), g, beta [N, H],
    states [slots, H, Dv, Dk] float32 contiguous (value-major), updated in place at slots[N] (distinct, slot 0
    for padding rows, whose state is not written). Returns out [N, H, Dv] float32 (a padding row's is not meaningful).

    raw_gates=(decay_rate, dt_bias), float32 [H] each: g and beta are the raw projections a and b, and the
    kernel makes the log decay -exp(A_log) * softplus(a + dt_bias) (decay_rate = -exp(A_log)) and sigmoid(b).
    block: value dims per program (None: value_block's choice for the batch)."""
    n, heads, dv = v.shape
    dk = k.shape[-1]
    assert states.is_contiguous() and states.dtype == torch.float32 and states.shape[1:] == (heads, dv, dk)
    assert q.stride() == k.stride() and q.stride(-1) == 1 and v.stride(-1) == 1
    assert g.stride() == beta.stride() and g.stride(-1) == 1
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)  # out: [N, H, Dv]
    bv = value_block(n, heads, dv) if block is None else block
    decay_rate, dt_bias = (g, g) if raw_gates is None else raw_gates
    if raw_gates is not None and not all(t.shape == (heads,) and t.dtype == torch.float32 for t in raw_gates):
        raise ValueError(f"raw_gates must be float32 [{heads}] each")
    _step_at_slots_kernel[(n, heads, triton.cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
        decay_rate,
        dt_bias,
        states,
        slots,
        out,
        q.stride(0),
        q.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        states.shape[0],
        dk**-0.5,
        HEADS=heads,
        GROUP=heads // k.shape[1],
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        RAW_GATES=raw_gates is not None,
        num_warps=max(1, bv // 8),
        **dependent(q.device),
    )
    return out


@triton.jit
def conv_channels(x_row, weight_ptr, window, cols, live, WIDTH: tl.constexpr):
    """One token's causal conv with SiLU at channels `cols` (x_row: its inputs; window: its slot's [C, K - 1]
    windows, oldest first), summed oldest first in float32 as conv1d_step's (window * weight).sum(-1), rounded to
    x's dtype, returned float32."""
    at = window + cols * (WIDTH - 1)
    taps = weight_ptr + cols * WIDTH
    acc = tl.load(at, mask=live, other=0.0).to(tl.float32) * tl.load(taps, mask=live, other=0.0).to(
        tl.float32
    )
    for j in tl.static_range(1, WIDTH - 1):
        acc += tl.load(at + j, mask=live, other=0.0).to(tl.float32) * tl.load(
            taps + j, mask=live, other=0.0
        ).to(tl.float32)
    x = tl.load(x_row + cols, mask=live, other=0.0)
    acc += x.to(tl.float32) * tl.load(taps + WIDTH - 1, mask=live, other=0.0).to(tl.float32)
    return (acc * tl.sigmoid(acc)).to(x.dtype).to(tl.float32)


@triton.jit
def move_window(x_row, window, cols, written, WIDTH: tl.constexpr, BW: tl.constexpr):
    """The windows at channels `cols` moved on by one token in place where `written`: entry j + 1 to j, the
    token's input the newest. Every thread reads its entries before any writes (a layout may give a channel to
    threads of several warps, which run apart)."""
    at = window + cols * (WIDTH - 1)
    steps = tl.arange(0, BW)  # a window's entries, BW = WIDTH - 1 rounded up to a power of two
    kept = written[:, None] & (steps >= 1)[None, :] & (steps < WIDTH - 1)[None, :]
    entries = tl.load(at[:, None] + steps[None, :], mask=kept)
    x = tl.load(x_row + cols, mask=written)
    tl.debug_barrier()
    tl.store(at[:, None] + steps[None, :] - 1, entries, mask=kept)
    tl.store(at + WIDTH - 2, x.to(window.dtype.element_ty), mask=written)


@triton.jit
def _conv_step_at_slots_kernel(
    x_ptr,
    weight_ptr,
    windows_ptr,
    slots_ptr,
    out_ptr,
    x_row_stride,
    channels,
    WIDTH: tl.constexpr,
    BW: tl.constexpr,
    BLOCK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_inputs(DEPENDENT)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    # the windows [BLOCK, BW] (WIDTH - 1 entries of BW live, oldest first) and the taps they meet, each loaded
    # once: the conv sums from them and the moved windows are stored from them (conv_channels and move_window,
    # the joined kernel's, load each window twice)
    steps = tl.arange(0, BW)
    held = live[:, None] & (steps < WIDTH - 1)[None, :]
    at = windows_ptr + (slot * channels + cols[:, None]) * (WIDTH - 1) + steps[None, :]
    entries = tl.load(at, mask=held, other=0.0)
    taps = tl.load(weight_ptr + cols[:, None] * WIDTH + steps[None, :], mask=held, other=0.0)
    x = tl.load(x_row + cols, mask=live, other=0.0)
    # oldest first in float32, as conv1d_step's (window * weight).sum(-1) (the masked entries add exact zeros)
    acc = tl.sum(entries.to(tl.float32) * taps.to(tl.float32), axis=1)
    acc += x.to(tl.float32) * tl.load(weight_ptr + cols * WIDTH + WIDTH - 1, mask=live, other=0.0).to(
        tl.float32
    )
    tl.store(out_ptr + row * channels + cols, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=live)
    # moved on in place: entry j + 1 to j, the token's input the newest. Every thread has loaded its entries
    # before any stores (a layout may give a channel's entries to threads of several warps). A padding row (the
    # sink slot) writes nothing, so the sink stays zero. (The slot is broadcast as an int first: Triton's
    # interpreter refuses a scalar bool in a mask.)
    written = live & (cols * 0 + slot != 0)
    tl.debug_barrier()
    tl.store(at - 1, entries, mask=held & written[:, None] & (steps >= 1)[None, :])
    newest = windows_ptr + (slot * channels + cols) * (WIDTH - 1) + WIDTH - 2
    tl.store(newest, x.to(entries.dtype), mask=written)


def conv_step_at_slots(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token of each of N sequences, x[N, C] (rows may be strided, channels contiguous), through the causal
    depthwise conv (weight [C, K] contiguous) after its window windows[slots[n]] ([slots, C, K - 1], contiguous,
    moved on in place; slot 0, padding, not written), SiLU applied. Returns out [N, C] in x's dtype. The
    gated delta net step's conv where the batch is too wide for delta_net_step_at_slots to win."""
    n, channels = x.shape
    width = weight.shape[1]
    if weight.shape != (channels, width) or windows.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"weight must be [{channels}, K] and windows [slots, {channels}, K - 1], got {tuple(weight.shape)}, "
            f"{tuple(windows.shape)}"
        )
    if x.stride(1) != 1 or not weight.is_contiguous() or not windows.is_contiguous():
        raise ValueError("x must be contiguous along channels, weight and windows contiguous")
    out = torch.empty(n, channels, dtype=x.dtype, device=x.device)  # out: [N, C]
    # 4 channels a thread, their windows [4, K - 1] in registers (H200, Qwen3.5-0.8B at 256 rows: 15 us a layer,
    # 24 with 1,024 channels a program)
    block = min(512, triton.next_power_of_2(channels))
    _conv_step_at_slots_kernel[(n, triton.cdiv(channels, block))](
        x,
        weight,
        windows,
        slots,
        out,
        x.stride(0),
        channels,
        WIDTH=width,
        BW=triton.next_power_of_2(width - 1),
        BLOCK=block,
        **dependent(x.device),
    )
    return out
