"""A packed prefill batch's recurrent states out of the state pool and back, by each sequence's slot (the CUDA
prefill of gated_delta_fla): the initial states gathered, zeros where a sequence starts fresh, and the final
ones scattered, the sink slot (a graph's padding sequences') left unwritten. One launch each where torch took
two (index_select and a multiply) and two (index_copy and zeroing the sink again)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from executor_svc.kernels.gated_delta_fla import Packed

_BLOCK = 2048  # values a program moves (8 KB of float32)


@triton.jit
def _gather_kernel(pool_ptr, slots_ptr, kept_ptr, out_ptr, size, BLOCK: tl.constexpr):
    seq, block = tl.program_id(0), tl.program_id(1)
    at = block * BLOCK + tl.arange(0, BLOCK)
    live = at < size
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # (the flag broadcast as an int first: Triton's interpreter refuses a scalar bool in a mask)
    kept = at * 0 + tl.load(kept_ptr + seq) != 0
    values = tl.load(pool_ptr + slot * size + at, mask=live & kept, other=0.0)
    tl.store(out_ptr + seq.to(tl.int64) * size + at, values, mask=live)


@triton.jit
def _scatter_kernel(states_ptr, slots_ptr, pool_ptr, size, BLOCK: tl.constexpr):
    seq, block = tl.program_id(0), tl.program_id(1)
    at = block * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = at < size
    live &= at * 0 + slot != 0  # a padding sequence (at the sink) moves nothing
    values = tl.load(states_ptr + seq.to(tl.int64) * size + at, mask=live)
    tl.store(pool_ptr + slot * size + at, values, mask=live)


def gather_states(pool: torch.Tensor, packed: Packed) -> torch.Tensor:
    """pool [slots, ...] (one layer's, contiguous) -> [N, ...]: sequence i's state at packed.slots[i], zeros
    where packed.kept[i] is 0."""
    n, size = packed.slots.shape[0], pool[0].numel()
    if not pool.is_contiguous():
        raise ValueError("the pool must be contiguous: a slot's state is found at slot * its size")
    out = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _gather_kernel[(n, triton.cdiv(size, _BLOCK))](pool, packed.slots, packed.kept, out, size, BLOCK=_BLOCK)
    return out


def scatter_states(states: torch.Tensor, pool: torch.Tensor, packed: Packed) -> None:
    """pool[packed.slots[i]] = states[i] (states [N, ...] contiguous, like pool's slots), but at the sink slot 0,
    which keeps its zeros."""
    n, size = packed.slots.shape[0], pool[0].numel()
    if states.shape != (n, *pool.shape[1:]) or not states.is_contiguous() or not pool.is_contiguous():
        raise ValueError(
            f"states must be contiguous [{n}, {', '.join(map(str, pool.shape[1:]))}], and the pool contiguous"
        )
    _scatter_kernel[(n, triton.cdiv(size, _BLOCK))](states, packed.slots, pool, size, BLOCK=_BLOCK)
