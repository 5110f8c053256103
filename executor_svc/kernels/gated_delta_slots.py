"""A gated delta net layer's decode step in Triton, reading and writing each row's conv window and recurrent
state in the state pool at its slot (as attention reads pages by slot): no gather of the states into a batch and
no scatter back. The contracts of gated_delta_ref's conv1d_step and delta_rule_step_at_slots, which stay the CPU
path; fixed shapes and no host sync, so a CUDA graph captures them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Value dims per program: a [Dk, 8] float32 tile of the state on one warp (fla-core's and vLLM's choice for their
# fused recurrent kernel) gives many programs at small batches (Qwen3.5-0.8B: 16 heads x 128 / 8 = 256 a row),
# but its 32-byte rows waste memory bandwidth once the batch fills the GPU: wider tiles then.
_PROGRAMS_WANTED = 2048


def value_block(rows: int, heads: int, dv: int) -> int:
    """The widest value block of 8, 16 or 32 that still gives _PROGRAMS_WANTED programs, else 8."""
    widest = min(32, triton.next_power_of_2(dv))
    for block in (32, 16):
        if block <= widest and rows * heads * triton.cdiv(dv, block) >= _PROGRAMS_WANTED:
            return block
    return min(8, widest)


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
    scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    RAW_GATES: tl.constexpr,
):
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    keys = tl.arange(0, BK)
    values = block * BV + tl.arange(0, BV)
    key_live, value_live = keys < DK, values < DV
    slot = tl.load(slots_ptr + row).to(tl.int64)
    qk = row * qk_row_stride + (head // GROUP) * qk_head_stride + keys
    q = tl.load(q_ptr + qk, mask=key_live, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk, mask=key_live, other=0.0).to(tl.float32)
    # l2-normed q and k (eps inside the root, as fla and transformers), q scaled by Dk^-0.5
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + row * v_row_stride + head * v_head_stride + values, mask=value_live, other=0.0)
    g = tl.load(g_ptr + row * gate_row_stride + head).to(tl.float32)
    b = tl.load(beta_ptr + row * gate_row_stride + head)
    if RAW_GATES:
        # g, beta from the projections a, b as the model computes them: beta = sigmoid(b) rounded to the
        # dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32 (softplus linear above 20, as torch's)
        b = tl.sigmoid(b.to(tl.float32)).to(beta_ptr.dtype.element_ty)
        g = g + tl.load(dt_bias_ptr + head)
        g = tl.load(decay_rate_ptr + head) * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    decay = tl.exp(g)
    beta = b.to(tl.float32)
    # the state tile [BK, BV] of this row's slot and head, float32
    tile = states_ptr + ((slot * HEADS + head) * DK + keys[:, None]) * DV + values[None, :]
    live = key_live[:, None] & value_live[None, :]
    state = tl.load(tile, mask=live, other=0.0) * decay
    remembered = tl.sum(state * k[:, None], axis=0)  # remembered: [BV], what the state says of k
    delta = (v.to(tl.float32) - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (row * HEADS + head) * DV + values, out, mask=value_live)
    # A padding row reads the sink slot (zeros) and writes nothing back: slot 0 stays zero. (The slot is
    # broadcast as an int first: Triton's interpreter refuses a scalar bool in a mask.)
    tl.store(tile, state, mask=live & (keys[:, None] * 0 + slot != 0))


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
    states [slots, H, Dk, Dv] float32 contiguous, updated in place at slots[N] (distinct, slot 0 for padding
    rows, whose state is not written). Returns out [N, H, Dv] float32 (a padding row's is not meaningful).

    raw_gates=(decay_rate, dt_bias), float32 [H] each: g and beta are the raw projections a and b, and the
    kernel makes the log decay -exp(A_log) * softplus(a + dt_bias) (decay_rate = -exp(A_log)) and sigmoid(b).
    block: value dims per program (None: value_block's choice for the batch)."""
    n, heads, dv = v.shape
    dk = k.shape[-1]
    assert states.is_contiguous() and states.dtype == torch.float32 and states.shape[1:] == (heads, dk, dv)
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
        dk**-0.5,
        HEADS=heads,
        GROUP=heads // k.shape[1],
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        RAW_GATES=raw_gates is not None,
        num_warps=max(1, bv // 8),
    )
    return out


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
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=live, other=0.0)
    window = windows_ptr + (slot * channels + cols) * (
        WIDTH - 1
    )  # this slot's [C, K - 1] window, oldest first
    taps = weight_ptr + cols * WIDTH
    # Summed oldest first in float32, as the reference's (window * weight).sum(-1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(WIDTH - 1):
        acc += tl.load(window + j, mask=live, other=0.0).to(tl.float32) * tl.load(taps + j, mask=live).to(
            tl.float32
        )
    acc += x.to(tl.float32) * tl.load(taps + WIDTH - 1, mask=live).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * channels + cols, out.to(out_ptr.dtype.element_ty), mask=live)
    # The window moves on by one, in place: each lane reads j + 1 before it writes j. A padding row (the sink
    # slot) writes nothing, so the sink stays zero.
    keep = live & (cols * 0 + slot != 0)
    for j in tl.static_range(WIDTH - 2):
        tl.store(window + j, tl.load(window + j + 1, mask=keep), mask=keep)
    tl.store(window + WIDTH - 2, x.to(windows_ptr.dtype.element_ty), mask=keep)


def conv_step_at_slots(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token of each of N sequences, x[N, C] (rows may be strided, channels contiguous), through the causal
    depthwise conv (weight [C, K] contiguous) after its window windows[slots[n]] ([slots, C, K - 1], contiguous,
    moved on in place; slot 0, padding, not written), SiLU applied. Returns out [N, C] in x's dtype."""
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
    block = min(1024, triton.next_power_of_2(channels))
    _conv_step_at_slots_kernel[(n, triton.cdiv(channels, block))](
        x, weight, windows, slots, out, x.stride(0), channels, WIDTH=width, BLOCK=block
    )
    return out
