"""A gated delta net layer's decode step in Triton, reading and writing each row's conv window and recurrent
state in the state pool at its slot (as attention reads pages by slot): no gather of the states into a batch and
no scatter back. The contracts of gated_delta_ref's conv1d_step and delta_rule_step_at_slots, which stay the CPU
path; fixed shapes and no host sync, so a CUDA graph captures them.

Two kernels: the rule step alone (the torch forward's, on CUDA), and the layer's whole step after its projection
(conv, rule and gated norm in one launch, the Triton-kernels forward's)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.fused import gated_norm

# Value dims per program: a [Dk, 8] float32 tile of the state on one warp (fla-core's and vLLM's choice for their
# fused recurrent kernel) gives many programs at small batches (Qwen3.5-0.8B: 16 heads x 128 / 8 = 256 a row),
# but its 32-byte rows waste memory bandwidth once the batch fills the GPU: wider tiles then.
_PROGRAMS_WANTED = 2048
# Heads (rows x value heads) from which the one-kernel layer step gives each head one program (H200,
# Qwen3.5-0.8B's 16 heads a layer: a program a block took 6.5 us at one row against 11.4 for a program a head,
# both 17.5 at 16 rows, 62 against 50 at 64)
_PROGRAMS_FOR_WHOLE_HEADS = 1024


def value_block(rows: int, heads: int, dv: int) -> int:
    """The widest value block of 8, 16 or 32 that still gives _PROGRAMS_WANTED programs, else 8."""
    widest = min(32, triton.next_power_of_2(dv))
    for block in (32, 16):
        if block <= widest and rows * heads * triton.cdiv(dv, block) >= _PROGRAMS_WANTED:
            return block
    return min(8, widest)


def step_tile(rows: int, heads: int, dv: int) -> tuple[int, int, int]:
    """delta_net_step_at_slots' tile for a batch of `rows`: (value dims a block, blocks a program, warps). The rule
    step's value_block; each head's blocks spread over programs of their own while the batch gives fewer than
    _PROGRAMS_FOR_WHOLE_HEADS heads (each program repeats its key head's q and k conv and norms, and only the
    last finishes the head), else one program a head."""
    block = value_block(rows, heads, dv)
    blocks = triton.cdiv(dv, block)
    return block, 1 if rows * heads < _PROGRAMS_FOR_WHOLE_HEADS else blocks, max(1, block // 8)


@triton.jit
def _decay_and_beta(g_at, b_at, decay_rate_ptr, dt_bias_ptr, head, RAW_GATES: tl.constexpr):
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
def _normed_qk(q, k, scale):
    """l2-normed q and k (eps inside the root, as fla and transformers), q scaled by Dk^-0.5."""
    return q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale, k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)


@triton.jit
def _rule_tile(tile, live, written, q, k, v, decay, beta):
    """The rule's step on the state tile [BK, BV] at `tile` (float32, masked by `live`), stored back where
    `written`: q, k [BK] normed, v [BV], decay and beta float32. Returns out [BV], float32."""
    state = tl.load(tile, mask=live, other=0.0) * decay
    remembered = tl.sum(state * k[:, None], axis=0)  # remembered: [BV], what the state says of k
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(tile, state, mask=written)
    return tl.sum(state * q[:, None], axis=0)


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
    q, k = _normed_qk(q, k, scale)
    v = tl.load(v_ptr + row * v_row_stride + head * v_head_stride + values, mask=value_live, other=0.0)
    gates = row * gate_row_stride + head
    decay, beta = _decay_and_beta(
        g_ptr + gates, beta_ptr + gates, decay_rate_ptr, dt_bias_ptr, head, RAW_GATES
    )
    # the state tile [BK, BV] of this row's slot and head, float32. A padding row reads the sink slot (zeros)
    # and writes nothing back: slot 0 stays zero. (The slot is broadcast as an int first: Triton's interpreter
    # refuses a scalar bool in a mask.)
    tile = states_ptr + ((slot * HEADS + head) * DK + keys[:, None]) * DV + values[None, :]
    live = key_live[:, None] & value_live[None, :]
    out = _rule_tile(tile, live, live & (keys[:, None] * 0 + slot != 0), q, k, v.to(tl.float32), decay, beta)
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
def _conv_channels(x_row, weight_ptr, window, cols, live, WIDTH: tl.constexpr):
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
def _move_window(x_row, window, cols, written, WIDTH: tl.constexpr):
    """The windows at channels `cols` moved on by one token in place where `written`: each lane reads entry
    j + 1 before it writes j, and the token's input becomes the newest entry."""
    at = window + cols * (WIDTH - 1)
    for j in tl.static_range(WIDTH - 2):
        tl.store(at + j, tl.load(at + j + 1, mask=written), mask=written)
    tl.store(at + WIDTH - 2, tl.load(x_row + cols, mask=written).to(window.dtype.element_ty), mask=written)


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
    channels,
    scale,
    eps,
    KEY_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BLOCKS: tl.constexpr,
    BD: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # One program a row, value head and share of its values (BLOCKS blocks of BV, one after the other): each
    # computes its key head's q and k from their windows and moves its own v channels' windows on; the last of a
    # key head's programs to finish moves the q and k windows on (once every program has read them) and norms its
    # heads (once every block is stored). A padding row (the sink slot) reads zeros, writes no state or window.
    row, head, share = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    key_head = head // GROUP
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    window = windows_ptr + slot * channels * (WIDTH - 1)
    keys = tl.arange(0, BK)
    key_live = keys < DK
    q_cols, k_cols = key_head * DK + keys, (KEY_HEADS + key_head) * DK + keys
    q = _conv_channels(x_row, conv_weight_ptr, window, q_cols, key_live, WIDTH)
    k = _conv_channels(x_row, conv_weight_ptr, window, k_cols, key_live, WIDTH)
    q, k = _normed_qk(q, k, scale)
    gates = row * gate_row_stride + head
    decay, beta = _decay_and_beta(a_ptr + gates, b_ptr + gates, decay_rate_ptr, dt_bias_ptr, head, True)
    for block in tl.static_range(BLOCKS):
        values = (share * BLOCKS + block) * BV + tl.arange(0, BV)
        value_live = values < DV
        v_cols = 2 * KEY_HEADS * DK + head * DV + values
        v = _conv_channels(x_row, conv_weight_ptr, window, v_cols, value_live, WIDTH)
        # (the slot broadcast as an int first: Triton's interpreter refuses a scalar bool in a mask)
        _move_window(x_row, window, v_cols, value_live & (values * 0 + slot != 0), WIDTH)
        tile = states_ptr + ((slot * KEY_HEADS * GROUP + head) * DK + keys[:, None]) * DV + values[None, :]
        live = key_live[:, None] & value_live[None, :]
        core = _rule_tile(tile, live, live & (keys[:, None] * 0 + slot != 0), q, k, v, decay, beta)
        tl.store(core_ptr + (row * KEY_HEADS * GROUP + head) * DV + values, core, mask=value_live)
    # Release this block (every thread's stores and loads before the one atomic), and learn whether it was its
    # key head's last (acquire the others'): no second kernel.
    tl.debug_barrier()
    arrival = arrivals_ptr + row * KEY_HEADS + key_head
    if tl.atomic_add(arrival, 1, sem="acq_rel") == GROUP * tl.num_programs(2) - 1:
        key_written = key_live & (keys * 0 + slot != 0)
        _move_window(x_row, window, q_cols, key_written, WIDTH)
        _move_window(x_row, window, k_cols, key_written, WIDTH)
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
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """One token of each of N sequences through a gated delta net layer after its projections, in one launch:
    gated_rmsnorm(delta_rule_step_at_slots(conv_step(x), a, b, raw_gates=gates), z, *norm).

    x [N, C] (q | k | v before the conv), z [N, H Dv] (the output gate), a, b [N, H] (the raw gate
    projections): rows may be strided, last dims contiguous. The causal conv (conv_weight [C, K]) after each
    row's window windows[slots[n]] ([slots, C, K - 1]) with SiLU, then the rule on states[slots[n]] ([slots, H,
    Dk, Dv] float32), both moved on in place (slots distinct; slot 0, padding, not written); gates = (decay_rate,
    dt_bias) float32 [H] as delta_rule_step_at_slots' raw_gates; norm = (weight [Dv], eps). Returns [N, H Dv] in
    x's dtype (a padding row's is not meaningful).

    arrivals: int32[>= N * key_heads], zero, which the kernel leaves zero again (None: made here; a step's layers
    can share one). tile: (value dims a block, blocks a program, warps) (None: step_tile's choice)."""
    n, channels = x.shape
    heads, dk, dv = states.shape[1:]
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
    if arrivals.dtype != torch.int32 or arrivals.numel() < n * key_heads:
        raise ValueError(
            f"arrivals must be int32[>= {n * key_heads}], got {arrivals.dtype}[{arrivals.numel()}]"
        )
    bv, blocks, warps = step_tile(n, heads, dv) if tile is None else tile
    core = torch.empty(n, heads, dv, dtype=torch.float32, device=x.device)  # core: [N, H, Dv], the rule's out
    out = torch.empty(n, heads * dv, dtype=x.dtype, device=x.device)  # out: [N, H Dv]
    _delta_net_step_kernel[(n, heads, triton.cdiv(triton.cdiv(dv, bv), blocks))](
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
        x.stride(0),
        z.stride(0),
        a.stride(0),
        channels,
        dk**-0.5,
        eps,
        KEY_HEADS=key_heads,
        GROUP=heads // key_heads,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        BLOCKS=blocks,
        BD=triton.next_power_of_2(dv),
        WIDTH=width,
        num_warps=warps,
    )
    return out
