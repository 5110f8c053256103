"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, with counter-based noise (no host sync)."""

from __future__ import annotations

import torch

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 multiplication wraps).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_UNIFORM_BITS = 23  # k + 0.5 with k < 2**23 is exact in float32, so u lies strictly inside (0, 1)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bit patterns."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, v] in (0, 1): output v of a splitmix64 stream keyed by (seed[b], counter[b]).

    A pure function of (seed, counter, v): no state, whatever the batch.
    """
    stream = mix64(seed + mix64(counter * _GOLDEN))  # stream: [B]
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device)
    bits = mix64(stream[:, None] + index[None, :] * _GOLDEN)  # bits: [B, V]
    top = _shift_right(bits, 64 - _UNIFORM_BITS).to(torch.float32)
    return (top + 0.5) * (1.0 / (1 << _UNIFORM_BITS))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """tokens: int64[B] from logits: [B, V], float32 or the head's dtype (made float32 here).

    Greedy (argmax) where temperature == 0. Elsewhere: logits / temperature, keep the top_k best (0 = all)
    and those at least min_p times as likely as the best (None or 0 = all), then the smallest prefix of them
    whose probability reaches top_p (the best always kept), then a
    Gumbel-max draw whose noise depends only on (seed, counter, token id), so a seeded row repeats exactly
    whatever its batch neighbours. Every row takes every branch: fixed shapes, nothing read back.
    """
    batch, vocab = logits.shape
    logits = logits.float()
    greedy = logits.argmax(dim=-1)

    sampled_rows = temperature > 0
    scaled = logits / torch.where(sampled_rows, temperature, 1.0)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # both: [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    keep_sorted = rank < k[:, None]
    if min_p is not None:  # p >= min_p * p_max, as logits: log(0) = -inf keeps every token
        keep_sorted &= sorted_logits >= sorted_logits[:, :1] + torch.log(min_p)[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep_sorted, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = torch.zeros_like(keep_sorted).scatter(1, sorted_ids, keep_sorted)  # keep: [B, V] by token id

    gumbel = -torch.log(-torch.log(uniform_noise(seed, counter, vocab)))
    drawn = (scaled.masked_fill(~keep, float("-inf")) + gumbel).argmax(dim=-1)
    return torch.where(sampled_rows, drawn, greedy)
