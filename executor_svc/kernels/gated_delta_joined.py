"""A gated delta net layer's whole decode step after its projections in one Triton kernel: the conv, the rule
step and the gated norm (gated_delta_slots' conv and rule kernels and fused's gated norm, joined), reading and
moving on each row's conv window and recurrent state in the state pool at its slot. For the narrowest steps
(joined_step_wins: one row of 16 heads), where three launches a layer cost more than the one kernel's repeated
work."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.dependent import await_inputs, dependent
from executor_svc.kernels.fused import gated_norm
from executor_svc.kernels.gated_delta_slots import (
    conv_channels,
    decay_and_beta,
    move_window,
    normed_qk,
    prefetch_state,
    rule_tile,
    value_block,
)

# The one-kernel layer step (conv, rule, gated norm): each of its programs repeats its key head's q and k conv
# and norms, and the last of a key head's programs finishes the head. Since the step's kernels launch as
# programmatic dependents it wins only below this many heads a step, one row of Qwen3.5-0.8B's 16 (H100, a
# graph of 64 layers, the three kernels with rule blocks of 8: 4.97 us a layer against 4.93 at one row, 6.33
# against 5.53 at 2, 8.12 against 6.83 at 4, 19.3 against 16.7 at 16, 69.7 against 53.9 at 64; the H200 before
# dependent launch: 6.4 against 8.5 at one row). Its value blocks: the widest giving this many programs (at one
# row 6.4 us with blocks of 8, 6.8 with 32).
_JOINED_STEP_HEADS = 32
_JOINED_STEP_PROGRAMS = 256


def joined_step_wins(rows: int, heads: int) -> bool:
    """Whether delta_net_step_at_slots beats the three kernels it joins for a batch of `rows` (with `heads`
    value heads a layer)."""
    return rows * heads < _JOINED_STEP_HEADS


def joined_step_block(rows: int, heads: int, dv: int) -> int:
    """The widest value block of 32, 16 or 8 that gives delta_net_step_at_slots _JOINED_STEP_PROGRAMS programs,
    else 8."""
    return value_block(rows, heads, dv, _JOINED_STEP_PROGRAMS)


@triton.jit
def _delta_net_step_kernel(
    x_ptr,
    z_ptr,
    a_ptr,
    b_ptr,
    conv_weight_ptr,
    windows_ptr,
    states_ptr,
    slots_ptr,
    decay_rate_ptr,
    dt_bias_ptr,
    norm_weight_ptr,
    core_ptr,
    arrivals_ptr,
    out_ptr,
    x_row_stride,
    z_row_stride,
    gate_row_stride,
    slot_count,
    channels,
    scale,
    eps,
    KEY_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BD: tl.constexpr,
    WIDTH: tl.constexpr,
    BW: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    # One program a row, value head and block of its values, as the rule step alone: each computes its key
    # head's q and k from their windows and moves its own v channels' windows on; the last of a key head's
    # programs to finish moves the q and k windows on (once every program has read them) and norms its heads
    # (once every block is stored). A padding row (the sink slot) reads zeros and writes no state or window.
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    key_head = head // GROUP
    keys = tl.arange(0, BK)
    key_live = keys < DK
    values = block * BV + tl.arange(0, BV)
    prefetch_state(
        states_ptr, slots_ptr, row, slot_count, head, values, KEY_HEADS * GROUP, DV, DK, BK, DEPENDENT
    )
    await_inputs(DEPENDENT)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    value_live = values < DV
    # the state tile first: its load (the most bytes) overlaps the conv's
    tile = states_ptr + ((slot * KEY_HEADS * GROUP + head) * DV + values[None, :]) * DK + keys[:, None]
    live = key_live[:, None] & value_live[None, :]
    state = tl.load(tile, mask=live, other=0.0)
    x_row = x_ptr + row * x_row_stride
    window = windows_ptr + slot * channels * (WIDTH - 1)
    q_cols, k_cols = key_head * DK + keys, (KEY_HEADS + key_head) * DK + keys
    q = conv_channels(x_row, conv_weight_ptr, window, q_cols, key_live, WIDTH)
    k = conv_channels(x_row, conv_weight_ptr, window, k_cols, key_live, WIDTH)
    q, k = normed_qk(q, k, scale)
    v_cols = 2 * KEY_HEADS * DK + head * DV + values
    v = conv_channels(x_row, conv_weight_ptr, window, v_cols, value_live, WIDTH)
    # (the slot broadcast as an int first: Triton's interpreter refuses a scalar bool in a mask)
    move_window(x_row, window, v_cols, value_live & (values * 0 + slot != 0), WIDTH, BW)
    gates = row * gate_row_stride + head
    decay, beta = decay_and_beta(a_ptr + gates, b_ptr + gates, decay_rate_ptr, dt_bias_ptr, head, True)
    core = rule_tile(state, tile, live & (keys[:, None] * 0 + slot != 0), q, k, v, decay, beta)
    tl.store(core_ptr + (row * KEY_HEADS * GROUP + head) * DV + values, core, mask=value_live)
    # Release this block (every thread's stores and loads before the one atomic), and learn whether it was its
    # key head's last (acquire the others'): no second kernel.
    tl.debug_barrier()
    arrival = arrivals_ptr + row * KEY_HEADS + key_head
    if tl.atomic_add(arrival, 1, sem="acq_rel") == GROUP * tl.num_programs(2) - 1:
        key_written = key_live & (keys * 0 + slot != 0)
        move_window(x_row, window, q_cols, key_written, WIDTH, BW)
        move_window(x_row, window, k_cols, key_written, WIDTH, BW)
        dims = tl.arange(0, BD)
        for member in tl.static_range(GROUP):
            at = (row * KEY_HEADS * GROUP + key_head * GROUP + member) * DV + dims
            # read past L1, which may hold none of the other programs' stores
            head_core = tl.load(core_ptr + at, mask=dims < DV, other=0.0, cache_modifier=".cg")
            head_gate = tl.load(
                z_ptr + row * z_row_stride + (key_head * GROUP + member) * DV + dims, mask=dims < DV
            )
            norm_weight = tl.load(norm_weight_ptr + dims, mask=dims < DV, other=0.0).to(tl.float32)
            tl.store(out_ptr + at, gated_norm(head_core, head_gate, norm_weight, DV, eps), mask=dims < DV)
        tl.store(arrival, 0)  # rearmed for the next layer's launch


def delta_net_step_at_slots(
    x: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    windows: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    gates: tuple[torch.Tensor, torch.Tensor],
    norm: tuple[torch.Tensor, float],
    key_heads: int,
    arrivals: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One token of each of N sequences through a gated delta net layer after its projections, in one launch:
    gated_rmsnorm(delta_rule_step_at_slots(conv_step(x), a, b, raw_gates=gates), z, *norm).

    x [N, C] (q | k | v before the conv), z [N, H Dv] (the output gate), a, b [N, H] (the raw gate
    projections): rows may be strided, last dims contiguous. The causal conv (conv_weight [C, K]) after each
    row's window windows[slots[n]] ([slots, C, K - 1]) with SiLU, then the rule on states[slots[n]] ([slots, H,
    Dv, Dk] float32, value-major), both moved on in place (slots distinct; slot 0, padding, not written); gates =
    (decay_rate, dt_bias) float32 [H] as delta_rule_step_at_slots' raw_gates; norm = (weight [Dv], eps). Returns
    [N, H Dv] in x's dtype (a padding row's is not meaningful).

    arrivals: int32[>= N * key_heads], zero, which the kernel leaves zero again (None: made here; a step's layers
    can share one). tile: (value dims a program takes, its warps) (None: joined_step_block's, on block // 8
    warps)."""
    n, channels = x.shape
    heads, dv, dk = states.shape[1:]
    width = conv_weight.shape[1]
    norm_weight, eps = norm
    if channels != 2 * key_heads * dk + heads * dv or heads % key_heads:
        raise ValueError(f"x must be [N, {2 * key_heads * dk + heads * dv}] for {key_heads} key heads")
    if conv_weight.shape != (channels, width) or windows.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv_weight must be [{channels}, K] and windows [slots, {channels}, K - 1]")
    if z.shape != (n, heads * dv) or a.shape != (n, heads) or b.stride() != a.stride() or b.shape != a.shape:
        raise ValueError(f"z must be [{n}, {heads * dv}], a and b [{n}, {heads}] of the same strides")
    if any(t.shape != (heads,) or t.dtype != torch.float32 for t in gates) or norm_weight.shape != (dv,):
        raise ValueError(f"gates must be float32 [{heads}] each and the norm weight [{dv}]")
    if any(t.stride(-1) != 1 for t in (x, z, a)) or x.dtype != z.dtype:
        raise ValueError("x, z, a and b must be contiguous along their last dim, x and z of one dtype")
    if not all(t.is_contiguous() for t in (conv_weight, windows, states, norm_weight)):
        raise ValueError("conv_weight, windows, states and the norm weight must be contiguous")
    assert states.dtype == torch.float32
    if arrivals is None:
        arrivals = torch.zeros(n * key_heads, dtype=torch.int32, device=x.device)
    if arrivals.dtype != torch.int32 or arrivals.numel() < n * key_heads or not arrivals.is_contiguous():
        raise ValueError(
            f"arrivals must be contiguous int32[>= {n * key_heads}], got {arrivals.dtype}[{arrivals.numel()}]"
        )
    if slots.shape != (n,) or any(t.device != x.device for t in (slots, arrivals, states, windows)):
        raise ValueError(f"slots must be [{n}], and slots, arrivals, states and windows on {x.device}")
    bv = joined_step_block(n, heads, dv) if tile is None else tile[0]
    core = torch.empty(n, heads, dv, dtype=torch.float32, device=x.device)  # core: [N, H, Dv], the rule's out
    out = torch.empty(n, heads * dv, dtype=x.dtype, device=x.device)  # out: [N, H Dv]
    grid = n, heads, triton.cdiv(dv, bv)
    _delta_net_step_kernel[grid](
        x,
        z,
        a,
        b,
        conv_weight,
        windows,
        states,
        slots,
        *gates,
        norm_weight,
        core,
        arrivals,
        out,
        x_row_stride=x.stride(0),
        z_row_stride=z.stride(0),
        gate_row_stride=a.stride(0),
        slot_count=states.shape[0],
        channels=channels,
        scale=dk**-0.5,
        eps=eps,
        KEY_HEADS=key_heads,
        GROUP=heads // key_heads,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        BD=triton.next_power_of_2(dv),
        WIDTH=width,
        BW=triton.next_power_of_2(width - 1),
        num_warps=max(1, bv // 8) if tile is None else tile[1],
        **dependent(x.device),
    )
    return out
