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
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(chunks_ptr + 2 * chunk)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    rows = start + tl.load(chunks_ptr + 2 * chunk + 1) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    # this program's head: of q, of k (DK channels each) or of v (DV)
    qk = head < 2 * HK
    size = tl.where(qk, DK, DV)
    channel = tl.where(qk, head * DK, 2 * HK * DK + (head - 2 * HK) * DV) + cols
    live = (rows < end)[:, None] & (cols < size)[None, :]
    slot = tl.load(slots_ptr + seq)
    kept = (rows * 0 + tl.load(kept_ptr + seq) != 0)[:, None]  # as a mask of the rows' shape
    window = windows_ptr + slot * CHANNELS * (WIDTH - 1) + channel[None, :] * (WIDTH - 1)
    # tap j reads the input WIDTH - 1 - j tokens back: a token of the sequence, else its window's entry
    # (zeros for a fresh sequence); summed oldest first in float32
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        at = rows - (WIDTH - 1) + j
        own = (at >= start)[:, None]
        x = tl.load(x_ptr + at[:, None] * x_row_stride + channel[None, :], mask=live & own, other=0.0)
        held = tl.load(window + (WIDTH - 1 + at - start)[:, None], mask=live & ~own & kept, other=0.0)
        tap = tl.load(weight_ptr + channel * WIDTH + j, mask=cols < size, other=0.0).to(tl.float32)
        acc += (x.to(tl.float32) + held.to(tl.float32)) * tap[None, :]
    out = (acc * tl.sigmoid(acc)).to(q_ptr.dtype.element_ty)
    if qk:  # x / |x| per head in float32 from the rounded output, eps inside the root
        normed = out.to(tl.float32)
        out = (normed * tl.rsqrt(tl.sum(normed * normed, axis=1) + 1e-6)[:, None]).to(q_ptr.dtype.element_ty)
    if head < HK:
        tl.store(q_ptr + rows[:, None] * (HK * DK) + head * DK + cols[None, :], out, mask=live)
    elif head < 2 * HK:
        tl.store(k_ptr + rows[:, None] * (HK * DK) + (head - HK) * DK + cols[None, :], out, mask=live)
    else:
        tl.store(v_ptr + rows[:, None] * (HV * DV) + (head - 2 * HK) * DV + cols[None, :], out, mask=live)


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
    x = tl.load(x_ptr + at[None, :] * x_row_stride + channel[:, None], mask=live & own, other=0.0)
    held = tl.load(window + (WIDTH - 1 + at - start)[None, :], mask=live & ~own & kept, other=0.0)
    # in place: this program alone reads and writes its slot's channels, and it has read them all; a padding
    # sequence (a graph's, at the sink slot) writes nothing, so the sink stays zero
    real = (steps * 0 + slot != 0)[None, :]
    tl.store(window + steps[None, :], tl.where(own, x.to(held.dtype), held), mask=live & real)


def conv_qkv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    packed: Packed,
    heads: tuple[int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, C] (q | k | v before the conv; rows may be strided) through the causal depthwise conv (weight [C, K]
    contiguous) after each sequence's window windows[slots[i]] ([slots, C, K - 1] contiguous; zeros where not
    kept), SiLU applied, split into heads = (Hk, Dk, Hv, Dv): q, k [T, Hk, Dk] l2-normed and v [T, Hv, Dv],
    contiguous, in x's dtype. Reads the windows, writes none (conv_windows moves them on)."""
    hk, dk, hv, dv = heads
    tokens, channels = x.shape
    width = weight.shape[1]
    if channels != 2 * hk * dk + hv * dv or weight.shape != (channels, width):
        raise ValueError(
            f"x must be [T, {2 * hk * dk + hv * dv}] and weight [C, K], got {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or not weight.is_contiguous() or not windows.is_contiguous():
        raise ValueError("x must be contiguous along channels, weight and windows contiguous")
    q, k = (torch.empty(tokens, hk, dk, dtype=x.dtype, device=x.device) for _ in range(2))
    v = torch.empty(tokens, hv, dv, dtype=x.dtype, device=x.device)
    _conv_kernel[(packed.chunk_indices.shape[0], 2 * hk + hv)](
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
        BT=CHUNK,
        BD=triton.next_power_of_2(max(dk, dv)),
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
