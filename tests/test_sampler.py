"""The sampler: greedy, top-k, top-p, and seeded draws that repeat whatever the batch."""

from __future__ import annotations

import pytest
import torch

from executor_svc.sampler import mix64, sample, uniform_noise

VOCAB = 1000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def params(rows: int, temperature=1.0, top_p=1.0, top_k=0, seed=0, counter=1):
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype)

    return (
        full(temperature, torch.float32),
        full(top_p, torch.float32),
        full(top_k, torch.int32),
        full(seed, torch.int64),
        full(counter, torch.int64),
    )


def test_mix64_is_splitmix64_on_uint64_bit_patterns():
    mask = (1 << 64) - 1

    def reference(x: int) -> int:
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & mask
        return x ^ (x >> 31)

    values = [0, 1, -1, 2**63 - 1, -(2**63), 123456789123, -98765]
    mixed = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [m & mask for m in mixed] == [reference(v & mask) for v in values]


def test_temperature_zero_is_argmax_whatever_top_k_and_top_p():
    logits = logits_of(6)
    tokens = sample(logits, *params(6, temperature=0.0, top_p=0.3, top_k=5, seed=9))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_of(8)
    counters = torch.arange(8, dtype=torch.int64)
    temperature, top_p, top_k, seed, _ = params(8, temperature=1.3, top_k=1, seed=4)
    assert torch.equal(sample(logits, temperature, top_p, top_k, seed, counters), logits.argmax(-1))
    temperature, top_p, top_k, seed, _ = params(8, temperature=1.3, top_p=1e-6, seed=4)
    assert torch.equal(sample(logits, temperature, top_p, top_k, seed, counters), logits.argmax(-1))


def test_seeded_draw_repeats_whatever_the_batch():
    logits = logits_of(5, seed=1)
    temperature, top_p, top_k, _, _ = params(5, temperature=1.0, top_p=0.95, top_k=200)
    seed = torch.tensor([11, 22, 33, 44, 55])
    counter = torch.tensor([7, 7, 8, 100, 3])
    together = sample(logits, temperature, top_p, top_k, seed, counter)
    for row in range(5):
        alone = sample(
            logits[row : row + 1], *(p[row : row + 1] for p in (temperature, top_p, top_k, seed, counter))
        )
        assert alone.item() == together[row].item()
    # Another batch: reversed, with new neighbours, in a wider batch.
    order = [4, 3, 2, 1, 0]
    wider_logits = torch.cat([logits[order], logits_of(3, seed=2)])
    wider = [torch.cat([p[order], p[:3] + 1]) for p in (temperature, top_p, top_k, seed, counter)]
    wider[1] = wider[1].clamp(max=1.0)
    shuffled = sample(wider_logits, *wider)
    assert shuffled[:5].tolist() == together[order].tolist()


def test_different_seeds_and_counters_draw_differently():
    logits = torch.zeros(64, VOCAB)  # uniform: only the noise decides
    counters = torch.arange(64, dtype=torch.int64)
    temperature, top_p, top_k, _, _ = params(64)
    first = sample(logits, temperature, top_p, top_k, torch.full((64,), 1), counters)
    second = sample(logits, temperature, top_p, top_k, torch.full((64,), 2), counters)
    assert (first != second).sum() > 50
    assert len(set(first.tolist())) > 50  # successive counters of one seed differ too


def test_draws_follow_the_softmax_within_top_k_and_top_p():
    rows = 20000
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(rows, -1).contiguous()
    counters = torch.arange(rows, dtype=torch.int64)
    temperature, top_p, top_k, seed, _ = params(rows, seed=123)
    counts = torch.bincount(sample(logits, temperature, top_p, top_k, seed, counters), minlength=5)
    assert torch.allclose(counts / rows, probs, atol=0.015)

    # top_k = 2 keeps 0.4 and 0.3, renormalised.
    counts = torch.bincount(sample(logits, temperature, top_p, top_k + 2, seed, counters), minlength=5)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / rows - 0.4 / 0.7) < 0.015

    # top_p = 0.8 keeps the smallest prefix reaching 0.8: 0.4 + 0.3 + 0.15.
    counts = torch.bincount(sample(logits, temperature, top_p * 0.8, top_k, seed, counters), minlength=5)
    assert counts[3:].sum() == 0
    assert abs(counts[2] / rows - 0.15 / 0.85) < 0.015


@pytest.mark.parametrize("device", DEVICES)
def test_the_draw_is_the_same_on_every_device(device: str):
    logits = logits_of(16, seed=3)
    args = (
        torch.full((16,), 0.8),
        torch.full((16,), 0.9),
        torch.full((16,), 50, dtype=torch.int32),
        torch.arange(16, dtype=torch.int64) * 7919,
        torch.arange(16, dtype=torch.int64) + 40,
    )
    here = sample(logits.to(device), *(a.to(device) for a in args)).cpu()
    assert torch.equal(here, sample(logits, *args))
    assert torch.equal(
        uniform_noise(args[3].to(device), args[4].to(device), VOCAB).cpu(),
        uniform_noise(args[3], args[4], VOCAB),
    )
