"""A gated delta net layer's prefill on CUDA: every sequence of the batch in one packed conv (gated_delta_conv's
Triton kernels) and one varlen pass of flash-linear-attention's chunked Triton kernels (fla-core, the `gpu`
extra; vLLM and SGLang use it), called below fla's autograd wrapper. Same contract as
gated_delta_ref.prefill_at_slots, which stays the CPU path and the fallback where fla-core is missing or fails.
(The decode step is gated_delta_slots', which reads the states by slot.)"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import structlog
import torch

from executor_svc.kernels import gated_delta_ref
from executor_svc.staging import upload_once

if TYPE_CHECKING:
    from executor_svc.state_pool import StateInputs

log = structlog.get_logger("deltaserve.executor.kernels")
Prefill = Callable[..., torch.Tensor]  # gated_delta_ref.prefill_at_slots' contract


CHUNK = 64  # tokens of a chunk of fla's kernels, and of a program of the conv kernel (they share the indices)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


class Packed(NamedTuple):
    """Where a packed batch's sequences lie, on the device (int64): what the conv kernels and fla's read, made
    once a step (not once a layer), exact or padded to a captured prefill graph's shape."""

    cu_seqlens: torch.Tensor  # [N + 1]: sequence i is tokens [cu_seqlens[i], cu_seqlens[i + 1])
    chunk_indices: torch.Tensor  # [chunks, 2]: (sequence, chunk within it) of each CHUNK tokens
    slots: torch.Tensor  # [N]: each sequence's state slot
    kept: torch.Tensor  # [N]: 1 where the sequence continues its slot's state, 0 where it starts fresh
    chunk_offsets: torch.Tensor  # [N + 1]: each sequence's first chunk

    @staticmethod
    def words(tokens: int, sequences: int) -> int:
        """The int64 words of a batch padded to `tokens` and `sequences`: its layout in a graph's buffer."""
        # the real ones and the padding tokens' (padding_starts), at least one empty one last
        held = sequences + 2
        return 4 * held + 2 + 2 * (-(-tokens // CHUNK) + held)

    @staticmethod
    def build(
        seq_starts: np.ndarray,
        fresh: np.ndarray,
        host_slots: np.ndarray,
        device: torch.device,
        shape: tuple[int, int] | None = None,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> Packed:
        """The index of sequences [seq_starts[i], seq_starts[i + 1]) at host_slots[i] (fresh[i]: from zeros),
        chunk indices and offsets made on the host (fla makes them once a call, with a read back) and copied in
        one copy from pinned memory, without a wait. `shape` (tokens, sequences) pads to a captured graph's
        sizes: the tokens past the real ones make fresh sequences at the sink slot (padding_starts), then
        sequences of none, and the padding chunks point at the last (their programs do nothing). `upload` puts the
        int64 words on the device and returns them there (a graph's staging); default: a buffer of their own."""
        starts = np.asarray(seq_starts, dtype=np.int64)
        slots = np.asarray(host_slots, dtype=np.int64)
        kept = (~np.asarray(fresh, dtype=bool)).astype(np.int64)
        if shape is not None:
            tokens, sequences = shape
            pad = sequences + 2 - len(slots)
            cuts = padding_starts(starts, tokens, pad - 1)
            starts = np.concatenate([starts, cuts, np.full(pad - len(cuts), tokens, dtype=np.int64)])
            slots, kept = (np.concatenate([x, np.zeros(pad, dtype=np.int64)]) for x in (slots, kept))
        n = len(slots)
        counts = -(-np.diff(starts) // CHUNK)  # chunks of each sequence
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        owner = np.repeat(np.arange(n), counts)
        chunks = np.stack([owner, np.arange(offsets[-1]) - offsets[owner]], axis=1)  # chunks: [NT, 2]
        if shape is not None:
            spare = -(-shape[0] // CHUNK) + n - len(chunks)
            chunks = np.concatenate([chunks, np.tile(np.array([[n - 1, 0]]), (spare, 1))])
        host = np.concatenate([starts, offsets, kept, slots, chunks.reshape(-1)])
        words = upload_once(host, device) if upload is None else upload(host)
        cu, chunk_offsets, kept_at, slots_at, chunk_indices = words.split(
            [n + 1, n + 1, n, n, 2 * len(chunks)]
        )
        return Packed(cu, chunk_indices.view(-1, 2), slots_at, kept_at, chunk_offsets)


def padding_starts(starts: np.ndarray, tokens: int, spare: int) -> np.ndarray:
    """Where the padding tokens [starts[-1], tokens) are cut into up to `spare` sequences: pieces of whole
    chunks, none of more chunks than the longest real sequence where `spare` allows. fla's state pass walks each
    sequence's chunks in series, so one long padding sequence (2,560 tokens where 11 prompts of 512 fill an
    8,192-token bucket) would take that step five times the chunks in series that its prompts need."""
    padding = tokens - int(starts[-1])
    longest = int(np.diff(starts).max(initial=1))
    piece = CHUNK * max(-(-longest // CHUNK), -(-padding // (CHUNK * max(spare, 1))))
    return np.arange(int(starts[-1]) + piece, tokens, piece, dtype=np.int64)


_last_packed: list[tuple[np.ndarray, Packed]] = []  # the step's, reused by its next layers


def packed_index(states: StateInputs, device: torch.device) -> Packed:
    """The step's Packed: the one the caller made (a graph's), else made at the step's first gated delta net
    layer and shared by the others."""
    if states.packed is not None:
        return states.packed
    assert states.seq_starts is not None and states.fresh is not None and states.host_slots is not None
    if not _last_packed or _last_packed[0][0] is not states.seq_starts:
        index = Packed.build(states.seq_starts, states.fresh, states.host_slots, device)
        _last_packed[:] = [(states.seq_starts, index)]
    return _last_packed[0][1]


@functools.cache
def _fla_forward() -> tuple[Callable[..., Any], ...]:
    """fla's forward pieces, below its autograd Function, input guards and backend dispatch (each a few hundred
    microseconds of host work a call that an inference step has no use for): fla-core 0.6's
    chunk_gated_delta_rule_fwd, step by step."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils.cumsum import chunk_local_cumsum_scalar

    pieces = (chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h, chunk_fwd_o)
    return (chunk_local_cumsum_scalar, *(inspect.unwrap(piece) for piece in pieces))


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    packed: Packed,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of every sequence of a packed batch in fla's chunked kernels: q, k [T, Hk, Dk]
    (l2-normed), v [T, H, Dv], all contiguous; g (log decay, float32) and beta [T, H]; initial [N, H, Dv, Dk]
    float32 (value-major, fla's state_v_first). Returns (out [T, H, Dv] in v's dtype, the final states [N, H,
    Dv, Dk] float32)."""
    from fla.ops.utils.constant import RCP_LN2

    cumsum, intra, states_of, out_of = _fla_forward()
    cu, chunks = packed.cu_seqlens, packed.chunk_indices
    q, k, v, g, beta = (x.contiguous()[None] for x in (q, k, v, g, beta))
    g = cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=chunks)  # fla works in exp2
    w, u, _ = intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=chunks)
    h, v_new, final = states_of(
        k=k,
        w=w,
        u=u,
        g=g,
        initial_state=initial,
        output_final_state=True,
        chunk_size=CHUNK,
        state_v_first=True,
        cu_seqlens=cu,
        chunk_indices=chunks,
        chunk_offsets=packed.chunk_offsets,
    )
    scale = q.shape[-1] ** -0.5
    out = out_of(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=g,
        scale=scale,
        state_v_first=True,
        cu_seqlens=cu,
        chunk_size=CHUNK,
        chunk_indices=chunks,
    )
    return out[0], final


def _prefill_fla(mixed, weight, g, beta, conv, recurrent, states: StateInputs, split) -> torch.Tensor:
    """gated_delta_ref.prefill_at_slots with the batch's sequences in one conv kernel and fla's chunked kernels;
    nothing is written to the pools until both have run. (The heads come from the pools' shapes: `split` is the
    reference's.)"""
    from executor_svc.kernels.gated_delta_conv import conv_qkv, conv_windows  # Triton: the gpu extra
    from executor_svc.kernels.state_moves import gather_states, scatter_states

    heads, dv, dk = recurrent.shape[1:]
    key_heads = (conv.shape[1] - heads * dv) // (2 * dk)
    packed = packed_index(states, conv.device)
    q, k, v = conv_qkv(mixed, weight, conv, packed, (key_heads, dk, heads, dv))
    out, final = chunked_rule(q, k, v, g, beta, gather_states(recurrent, packed), packed)
    conv_windows(mixed, conv, packed)
    scatter_states(final, recurrent, packed)  # not at the sink slot: the padding sequences' states
    return out


class _FallBack:
    """fla's chunked kernel, and the torch reference from its first failure on (logged once): a prefill that
    the kernel cannot run still gives the right state (the kernel writes nothing before it has run)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, *args) -> torch.Tensor:
        if not self.failed:
            try:
                return _prefill_fla(*args)
            except Exception as err:  # any failure of the kernel falls back, said why
                self.failed = True
                log.warning(
                    f"fla-core's chunked gated delta rule failed ({type(err).__name__}: {err}); prefill "
                    "runs the torch reference from now on"
                )
        return gated_delta_ref.prefill_at_slots(*args)


def capturable(prefill: Prefill) -> bool:
    """Whether a CUDA graph can hold `prefill`: fla's kernels, not (or not yet) fallen back (the reference
    loops over the sequences on the host)."""
    return isinstance(prefill, _FallBack) and not prefill.failed


def prefill_for(device: torch.device, dtype: torch.dtype) -> Prefill:
    """fla's chunked kernel on CUDA for 16-bit models (its matmuls run in TF32 on float32 inputs, off from
    transformers' fp32 by more than the parity checks allow), the torch reference otherwise."""
    if fla_available() and device.type == "cuda" and dtype != torch.float32:
        return _FallBack()
    return gated_delta_ref.prefill_at_slots
