"""Torch reference of a gated delta net layer's two stateful ops, by sequence: the causal depthwise conv1d
with its rolling input window, and the gated delta rule with its recurrent state (the CPU path, and the
reference the kernels of gated_delta_fla and gated_delta_slots are checked against). Float32 inside, as
transformers' torch fallback computes.

Shapes: C conv channels, K kernel width; H value heads, Dk key and Dv value head sizes; a conv state is the
last K - 1 inputs [C, K - 1] (oldest first), a recurrent state [H, Dv, Dk] (value-major, as the pool keeps it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from executor_svc.state_pool import StateInputs

# mixed [T, C] (q | k | v after the conv) -> q, k [T, Hk, Dk], v [T, H, Dv]
SplitHeads = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

CHUNK = 64  # tokens per block of the chunked rule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim, as fla's (and transformers') use_qk_l2norm_in_kernel does."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv1d_sequence(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens x[T, C] through the causal conv (weight [C, K]) after the window `state`
    [C, K - 1] (None: zeros, a fresh sequence), SiLU applied. Returns (out [T, C], the new window)."""
    t, channels = x.shape
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(channels, width - 1)
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # window: [C, K - 1 + T]
    out = F.conv1d(window[None].float(), weight.float()[:, None, :], groups=channels)[0]  # out: [C, T]
    return F.silu(out).t().to(x.dtype), window[:, -(width - 1) :]


def conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences, x[N, C], after its window state[N, C, K - 1]. Returns (out [N, C],
    the new windows [N, C, K - 1])."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # window: [N, C, K]
    out = (window.float() * weight.float()[None]).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def _prepare(q, k, v, g, beta):
    """Heads of q, k repeated to v's, all float32, q and k l2-normed, q scaled by Dk^-0.5."""
    heads = v.shape[-2]
    if q.shape[-2] != heads:
        q = q.repeat_interleave(heads // q.shape[-2], dim=-2)
        k = k.repeat_interleave(heads // k.shape[-2], dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences: q, k [N, Hk, Dk], v [N, H, Dv], g (log decay), beta [N, H], state
    [N, H, Dv, Dk] (float32, value-major as the pool's). Returns (out [N, H, Dv] float32, the new state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = state.float() * g.exp()[..., None, None]
    remembered = (state * k[..., None, :]).sum(-1)  # remembered: [N, H, Dv], what the state says of k
    delta = (v - remembered) * beta[..., None]
    state = state + delta[..., :, None] * k[..., None, :]
    return (state * q[..., None, :]).sum(-1), state


def delta_rule_step_at_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """delta_rule_step on the states [slots, H, Dv, Dk] (float32) of the pool at slots[N] (distinct; slot 0, the
    sink, for padding rows), updated in place; a padding row writes zeros back, so the sink stays zero.
    Returns out [N, H, Dv] float32. The contract of gated_delta_slots' Triton kernel, which needs no gather."""
    out, state = delta_rule_step(q, k, v, g, beta, states.index_select(0, slots))
    states.index_copy_(0, slots, state * (slots != 0)[:, None, None, None])
    return out


def delta_rule_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens, chunked (CHUNK at a time, exact up to float rounding): q, k [T, Hk, Dk],
    v [T, H, Dv], g, beta [T, H], state [H, Dv, Dk] (value-major, as the pool's) or None (zeros). Returns (out
    [T, H, Dv], final state [H, Dv, Dk]), float32. The chunked form of transformers'
    torch_chunk_gated_delta_rule, for one sequence (its state [H, Dk, Dv] inside)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    t, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -t % CHUNK
    # [H, chunks, CHUNK, ...]; padding tokens have k = v = 0, beta = 0 and g = 0: they change nothing
    q, k, v = (
        F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(heads, -1, CHUNK, x.shape[-1])
        for x in (q, k, v)
    )
    g, beta = (F.pad(x, (0, 0, 0, pad)).t().reshape(heads, -1, CHUNK) for x in (g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    g = g.cumsum(-1)  # within each chunk
    upper = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device))
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()  # decay[i, j]: from j to i, i >= j
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, CHUNK):  # solve the unit lower triangular system, row by row
        attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :i, None] * attn[..., :i, :i]).sum(-2)
    attn = attn + torch.eye(CHUNK, device=q.device)
    v_new_all = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp()[..., None])
    s = q.new_zeros(heads, dk, dv) if state is None else state.float().transpose(-1, -2)
    out = torch.zeros_like(v)
    strict = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=1)
    for c in range(q.shape[1]):
        qc, kc, gc = q[:, c], k[:, c], g[:, c]
        inner = (qc @ kc.transpose(-1, -2) * decay[:, c]).masked_fill(strict, 0)
        v_new = v_new_all[:, c] - k_cumdecay[:, c] @ s
        out[:, c] = (qc * gc.exp()[..., None]) @ s + inner @ v_new
        s = (
            s * gc[:, -1, None, None].exp()
            + (kc * (gc[:, -1:] - gc).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    return out.reshape(heads, -1, dv)[:, :t].transpose(0, 1), s.transpose(-1, -2)


def prefill_at_slots(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    states: StateInputs,
    split: SplitHeads,
) -> torch.Tensor:
    """A packed prefill batch through one gated delta net layer's conv and rule, sequence by sequence: mixed
    [T, C] (before the conv), g, beta [T, H]; sequence i is tokens [seq_starts[i], seq_starts[i + 1]) from the
    state at host_slots[i] of the layer's pools conv [slots, C, K - 1] and recurrent [slots, H, Dv, Dk] (zeros
    where fresh[i]), which it leaves there. Returns out [T, H, Dv] float32."""
    assert states.seq_starts is not None and states.host_slots is not None and states.fresh is not None
    outs = []
    bounds = states.seq_starts
    for i, slot in enumerate(states.host_slots.tolist()):
        part = slice(int(bounds[i]), int(bounds[i + 1]))
        fresh = bool(states.fresh[i])
        mixed_i, conv[slot] = conv1d_sequence(mixed[part], weight, None if fresh else conv[slot])
        out_i, recurrent[slot] = delta_rule_sequence(
            *split(mixed_i), g[part], beta[part], None if fresh else recurrent[slot]
        )
        outs.append(out_i)
    return torch.cat(outs)
