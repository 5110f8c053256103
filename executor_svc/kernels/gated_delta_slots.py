"""The gated delta rule's decode step in Triton, reading and writing each row's recurrent state in the state pool
at its slot (as attention reads pages by slot): no gather of the states into a batch and no scatter back. The
contract of gated_delta_ref.delta_rule_step_at_slots, which stays the CPU path; fixed shapes and no host sync,
so a CUDA graph captures it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Value dims per program, a [Dk, 8] float32 tile of the state, on one warp: fla-core's and vLLM's choice for their
# fused recurrent kernel (many programs even at batch 1: Qwen3.5-0.8B's 16 heads x 128 / 8 = 256 a row).
_VALUE_BLOCK = 8


@triton.jit
def _step_at_slots_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
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
    decay = tl.exp(tl.load(g_ptr + row * gate_row_stride + head).to(tl.float32))
    beta = tl.load(beta_ptr + row * gate_row_stride + head).to(tl.float32)
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
) -> torch.Tensor:
    """One token of each of N sequences: q, k [N, Hk, Dk], v [N, H, Dv] (last dim contiguous), g, beta [N, H],
    states [slots, H, Dk, Dv] float32 contiguous, updated in place at slots[N] (distinct, slot 0 for padding
    rows, whose state is not written). Returns out [N, H, Dv] float32 (a padding row's is not meaningful)."""
    n, heads, dv = v.shape
    dk = k.shape[-1]
    assert states.is_contiguous() and states.dtype == torch.float32 and states.shape[1:] == (heads, dk, dv)
    assert q.stride() == k.stride() and q.stride(-1) == 1 and v.stride(-1) == 1
    assert g.stride() == beta.stride() and g.stride(-1) == 1
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)  # out: [N, H, Dv]
    bv = min(_VALUE_BLOCK, triton.next_power_of_2(dv))
    _step_at_slots_kernel[(n, heads, triton.cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
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
        num_warps=1,
    )
    return out
