"""A packed prefill batch's causal conv1d in two Triton kernels (the CUDA prefill of gated_delta_fla): the conv
with SiLU of every token, each sequence after its window in the state pool at its slot, written as the
contiguous q, k (l2-normed) and v that fla's chunked kernel reads; then each sequence's new window, in place.
Each rounds where gated_delta_ref.conv1d_sequence and fla's l2norm round. Two launches where torch took some
twenty (index builds, gathers, copies, the conv, the norms)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from executor_svc.kernels.gated_delta_fla import CHUNK

if TYPE_CHECKING:
    from executor_svc.kernels.gated_delta_fla import Packed


@triton.jit
def _taps(
    x_ptr,
    weight_ptr,
    window,
    rows,
    start,
    live,
    channels,
    x_row_stride,
    cols,
    SIZE: tl.constexpr,
    REACH: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    BD: tl.constexpr,
):
    """The conv's sum [ROWS, BD] over its WIDTH taps, float32, oldest first: tap j reads the input WIDTH - 1 - j
    tokens back, a token of the sequence, else (REACH) its window's entry. Straight-line code with REACH a
    compile-time argument, so every tap's loads can be in flight at once (behind a branch a tap's loads waited
    for the tap before)."""
    acc = tl.zeros([ROWS, BD], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        at = rows - (WIDTH - 1) + j
        own = (at >= start)[:, None]
        x = tl.load(x_ptr + at[:, None] * x_row_stride + channels[None, :], mask=live & own, other=0.0)
        x = x.to(tl.float32)
        if REACH:
            held_at = window + channels[None, :] * (WIDTH - 1) + (WIDTH - 1 + at - start)[:, None]
            x += tl.load(held_at, mask=live & ~own, other=0.0).to(tl.float32)
        tap = tl.load(weight_ptr + channels * WIDTH + j, mask=cols < SIZE, other=0.0).to(tl.float32)
        acc += x * tap[None, :]
    return acc


@triton.jit
def _conv_rows(
    x_ptr,
    weight_ptr,
    window,
    out_ptr,
    rows,
    start,
    stored,
    channel,
    x_row_stride,
    OUT_ROW_STRIDE: tl.constexpr,
    SIZE: tl.constexpr,
    NORM: tl.constexpr,
    REACH: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    BD: tl.constexpr,
):
    """One head's channels [channel, channel + SIZE) of `rows` [ROWS] (of the sequence from `start`) through the
    conv with SiLU (l2-normed per row where NORM), those `stored` [ROWS] stored at out_ptr's rows (a block's
    16 bytes a load and store); reading the window where REACH."""
    cols = tl.arange(0, BD)
    live = stored[:, None] & (cols < SIZE)[None, :]
    channels = channel + cols
    acc = _taps(
        x_ptr,
        weight_ptr,
        window,
        rows,
        start,
        live,
        channels,
        x_row_stride,
        cols,
        SIZE,
        REACH,
        WIDTH,
        ROWS,
        BD,
    )
    out = (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty)
    if NORM:  # x / |x| per head in float32 from the rounded output, eps inside the root
        normed = out.to(tl.float32)
        out = (normed * tl.rsqrt(tl.sum(normed * normed, axis=1) + 1e-6)[:, None]).to(
            out_ptr.dtype.element_ty
        )
    tl.store(out_ptr + rows[:, None] * OUT_ROW_STRIDE + cols[None, :], out, mask=live)


@triton.jit
def _conv_head(
    x_ptr,
    weight_ptr,
    window,
    out_ptr,
    rows,
    start,
    end,
    reaches_back,
    channel,
    x_row_stride,
    OUT_ROW_STRIDE: tl.constexpr,
    SIZE: tl.constexpr,
    NORM: tl.constexpr,
    WIDTH: tl.constexpr,
    BT: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
):
    """One head of the block's `rows` [BT] (its sequence [start, end)) through _conv_rows. `reaches_back`: the
    block begins its sequence and the sequence continues its slot's window, the only block whose first rows
    read the window. Those WIDTH - 1 rows go on a [BW, BD] tile of their own, after the block's others: the
    window's loads are 2-byte ones (a window's channels lie WIDTH - 1 entries apart), a register each, eight
    for each 16-byte load of the tokens; across the block's tile they set the registers, so the occupancy, of
    every program (at 16 tokens on 8 warps, ptxas 13.4 for sm90: 128 registers a thread, on the small tile 40).
    Each row's arithmetic is the same on either tile; the norm's float32 sum follows its tile's layout."""
    stored = (rows >= tl.where(reaches_back, start + WIDTH - 1, start)) & (rows < end)
    _conv_rows(
        x_ptr,
        weight_ptr,
        window,
        out_ptr,
        rows,
        start,
        stored,
        channel,
        x_row_stride,
        OUT_ROW_STRIDE,
        SIZE,
        NORM,
        False,
        WIDTH,
        BT,
        BD,
    )
    if reaches_back:
        held = start + tl.arange(0, BW)
        _conv_rows(
            x_ptr,
            weight_ptr,
            window,
            out_ptr,
            held,
            start,
            (held < start + WIDTH - 1) & (held < end),
            channel,
            x_row_stride,
            OUT_ROW_STRIDE,
            SIZE,
            NORM,
            True,
            WIDTH,
            BW,
            BD,
        )


@triton.jit
def _conv_kernel(
    x_ptr,
    weight_ptr,
    windows_ptr,
    cu_ptr,
    chunks_ptr,
    slots_ptr,
    kept_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    x_row_stride,
    CHANNELS: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    HV: tl.constexpr,
    DV: tl.constexpr,
    WIDTH: tl.constexpr,
    CHUNK: tl.constexpr,
    BT: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
):
    # BT tokens a program, CHUNK // BT programs to each of fla's chunks (whose index this reads)
    block, head = tl.program_id(0), tl.program_id(1)
    chunk = block // (CHUNK // BT)
    seq = tl.load(chunks_ptr + 2 * chunk)
    within = tl.load(chunks_ptr + 2 * chunk + 1)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    first = start + within * CHUNK + (block % (CHUNK // BT)) * BT
    rows = first + tl.arange(0, BT)
    # the window holds the WIDTH - 1 inputs before the sequence, all within reach of its first block alone
    # (conv_qkv has WIDTH - 1 <= BT)
    reaches_back = (first == start) & (tl.load(kept_ptr + seq) != 0)
    window = windows_ptr + tl.load(slots_ptr + seq) * CHANNELS * (WIDTH - 1)
    # this program's head: of q or k (DK channels each), or of v (DV); two call sites, as the norm and the head's
    # size are compile-time arguments of _conv_head
    if head < 2 * HK:
        out_at = tl.where(head < HK, q_ptr + head * DK, k_ptr + (head - HK) * DK)
        _conv_head(
            x_ptr,
            weight_ptr,
            window,
            out_at,
            rows,
            start,
            end,
            reaches_back,
            head * DK,
            x_row_stride,
            HK * DK,
            DK,
            True,
            WIDTH,
            BT,
            BW,
            BD,
        )
    else:
        out_at = v_ptr + (head - 2 * HK) * DV
        channel = 2 * HK * DK + (head - 2 * HK) * DV
        _conv_head(
            x_ptr,
            weight_ptr,
            window,
            out_at,
            rows,
            start,
            end,
            reaches_back,
            channel,
            x_row_stride,
            HV * DV,
            DV,
            False,
            WIDTH,
            BT,
            BW,
            BD,
        )


@triton.jit
def _windows_kernel(
    x_ptr,
    windows_ptr,
    cu_ptr,
    slots_ptr,
    kept_ptr,
    x_row_stride,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    BW: tl.constexpr,
    BC: tl.constexpr,
):
    seq, block = tl.program_id(0), tl.program_id(1)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq)
    channel = block * BC + tl.arange(0, BC)
    steps = tl.arange(0, BW)
    kept = (steps * 0 + tl.load(kept_ptr + seq) != 0)[None, :]  # as a mask of the steps' shape
    live = (channel < CHANNELS)[:, None] & (steps < WIDTH - 1)[None, :]
    # entry i of the new window: the input at end - (WIDTH - 1) + i, a token or an entry of the old window
    at = end - (WIDTH - 1) + steps
    own = (at >= start)[None, :]
    window = windows_ptr + slot * CHANNELS * (WIDTH - 1) + channel[:, None] * (WIDTH - 1)
    x = tl.load(
        x_ptr + at[None, :] * x_row_stride + channel[:, None],
        mask=live & own,
        other=0.0,
    )
    held = tl.load(window + (WIDTH - 1 + at - start)[None, :], mask=live & ~own & kept, other=0.0)
    # in place: this program alone reads and writes its slot's channels, and it has read them all; a padding
    # sequence (a graph's, at the sink slot) writes nothing, so the sink stays zero
    real = (steps * 0 + slot != 0)[None, :]
    tl.store(window + steps[None, :], tl.where(own, x.to(held.dtype), held), mask=live & real)


BLOCK_TOKENS = (16, 32, 64)  # conv_qkv's block_tokens: each divides CHUNK
WARPS = (1, 2, 4, 8)  # and its warps


def conv_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    packed: Packed,
    heads: tuple[int, int, int, int],
    *,
    block_tokens: int = 16,
    warps: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, C] (q | k | v before the conv; rows may be strided) through the causal depthwise conv (weight [C, K]
    contiguous) after each sequence's window windows[slots[i]] ([slots, C, K - 1] contiguous; zeros where not
    kept), SiLU applied, split into heads = (Hk, Dk, Hv, Dv): q, k [T, Hk, Dk] l2-normed and v [T, Hv, Dv],
    contiguous, in x's dtype. Reads the windows, writes none (conv_windows moves them on). A program is one
    head of `block_tokens` tokens of one of fla's chunks, on `warps` warps. The default, 16 on 2, was the
    fastest of bench/prefill_kernels.py's sweep on an H200 at 16 x 512 tokens (141.7 us a layer; 32 on 4 145.4;
    16 on 8, the most warps an SM, 284.1; the one 64-token program on 8 before it 227.6)."""
    hk, dk, hv, dv = heads
    tokens, channels = x.shape
    width = weight.shape[1]
    if channels != 2 * hk * dk + hv * dv or weight.shape != (channels, width):
        raise ValueError(
            f"x must be [T, {2 * hk * dk + hv * dv}] and weight [C, K], got {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or not weight.is_contiguous() or not windows.is_contiguous():
        raise ValueError("x must be contiguous along channels, weight and windows contiguous")
    if block_tokens not in BLOCK_TOKENS or CHUNK % block_tokens:
        raise ValueError(f"block_tokens must be one of {BLOCK_TOKENS} (dividing {CHUNK}), got {block_tokens}")
    if width - 1 > block_tokens:  # the kernel lets a sequence's first block alone read its window
        raise ValueError(f"a conv of width {width} reaches back past a block of {block_tokens} tokens")
    if warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, got {warps}")
    q, k = (torch.empty(tokens, hk, dk, dtype=x.dtype, device=x.device) for _ in range(2))
    v = torch.empty(tokens, hv, dv, dtype=x.dtype, device=x.device)
    blocks = packed.chunk_indices.shape[0] * (CHUNK // block_tokens)
    _conv_kernel[(blocks, 2 * hk + hv)](
        x,
        weight,
        windows,
        packed.cu_seqlens,
        packed.chunk_indices,
        packed.slots,
        packed.kept,
        q,
        k,
        v,
        x.stride(0),
        CHANNELS=channels,
        HK=hk,
        DK=dk,
        HV=hv,
        DV=dv,
        WIDTH=width,
        CHUNK=CHUNK,
        BT=block_tokens,
        BW=triton.next_power_of_2(width - 1),
        BD=triton.next_power_of_2(max(dk, dv)),
        num_warps=warps,
    )
    return q, k, v


def conv_windows(x: torch.Tensor, windows: torch.Tensor, packed: Packed) -> None:
    """Move each sequence's window windows[slots[i]] on past its tokens of x [T, C], in place: its last K - 1
    inputs (reaching into the old window, or zeros where not kept, for a sequence shorter than that). The sink
    slot (0, padding sequences') is not written."""
    channels = x.shape[1]
    width = windows.shape[2] + 1
    block = min(256, triton.next_power_of_2(channels))
    _windows_kernel[(packed.slots.shape[0], triton.cdiv(channels, block))](
        x,
        windows,
        packed.cu_seqlens,
        packed.slots,
        packed.kept,
        x.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        BW=triton.next_power_of_2(width - 1),
        BC=block,
    )
