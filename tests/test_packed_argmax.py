"""The greedy head (packed_argmax.c): its token is the argmax of the packed matmul's logits, ties to the lowest
row, in the native build and the portable one; what it does not serve (a row not finite, several rows, a head
not Q8_0) it says so, and the model's greedy step takes every logit then."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from executor_svc.models import packed_argmax, packed_kernel
from executor_svc.models.gguf_packing import pack_gguf
from executor_svc.models.packed import PackedWeight
from executor_svc.models.packed_argmax import GreedyHead


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if packed_argmax.library() is None:
        pytest.skip("no C compiler to build the greedy head")


def q8_head(rows: int, cols: int, seed: int, scale_dtype: torch.dtype = torch.float16) -> PackedWeight:
    matrix = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    weight = pack_gguf(gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0), "Q8_0", rows, cols)
    return PackedWeight(8, 0, weight.q, weight.scale.to(scale_dtype), None)


def full_argmax(weight: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return weight.matmul(x).argmax(-1)


@pytest.mark.parametrize("cols", [96, 576])  # 96: three groups, the last pair half full
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_tokens_are_the_full_logits_argmax(cols, scale_dtype):
    weight = q8_head(1000, cols, seed=cols, scale_dtype=scale_dtype)
    head = GreedyHead.over(weight)
    assert head is not None
    for seed in range(8):
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(seed))
        x[0, :32] = 0  # a group of zeros: its step is 0
        assert torch.equal(head.tokens(x), full_argmax(weight, x))


def test_near_ties_are_settled_by_the_full_logits():
    """Rows one quantum apart from one another: the rounded pass cannot tell them apart, the full one does."""
    base = q8_head(1, 576, seed=1)
    rng = np.random.default_rng(2)
    q = base.q.view(torch.int8).repeat(600, 1).clamp(-126, 126)
    q[torch.arange(600), torch.from_numpy(rng.integers(0, 576, 600))] += torch.from_numpy(
        rng.choice([-1, 1], 600).astype(np.int8)
    )
    weight = PackedWeight(8, 0, q.view(torch.uint8).contiguous(), base.scale.repeat(600, 1), None)
    head = GreedyHead.over(weight)
    assert head is not None
    for seed in range(20):
        x = torch.randn(1, 576, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(head.tokens(x), full_argmax(weight, x))


def test_equal_rows_give_the_lowest():
    weight = q8_head(50, 96, seed=3)
    q = weight.q.clone()
    q[41] = q[17] = q[29]
    tied = PackedWeight(8, 0, q, weight.scale.clone(), None)
    tied.scale[41] = tied.scale[17] = tied.scale[29]
    x = tied.dequantize_rows(torch.tensor([29]))  # the tied rows' own direction: their logit is the largest
    head = GreedyHead.over(tied)
    assert head is not None
    assert head.tokens(x).tolist() == [17] == full_argmax(tied, x).tolist()
    assert head.tokens(torch.zeros(1, 96)).tolist() == [0]  # every logit 0


def test_what_it_cannot_promise_is_left_to_the_logits():
    weight = q8_head(64, 96, seed=4)
    head = GreedyHead.over(weight)
    assert head is not None
    x = torch.randn(1, 96)
    x[0, 5] = float("nan")
    assert head.tokens(x) is None
    x[0, 5] = float("inf")
    assert head.tokens(x) is None
    assert head.tokens(torch.randn(2, 96)) is None
    q = weight.q.clone()
    q[3, 7] = 128  # int8 -128: its negation does not fit in 8 bits
    assert GreedyHead.over(PackedWeight(8, 0, q, weight.scale, None)) is None
    q4_1 = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q4_1)
    assert GreedyHead.over(pack_gguf(q4_1, "Q4_1", 4, 64)) is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64-v2")
def test_the_portable_build_finds_the_same_tokens(monkeypatch):
    """Built without AVX-512 (its plain C loops, which the CI machine otherwise never builds), against the
    portable packed matmul's logits."""
    portable = tuple(f for f in packed_kernel.FLAGS if not f.startswith("-march")) + ("-march=x86-64-v2",)
    matmul, argmax = packed_kernel.library(portable), packed_argmax.library(portable)
    monkeypatch.setattr(packed_kernel, "library", lambda: matmul)
    monkeypatch.setattr(packed_argmax, "library", lambda: argmax)
    weight = q8_head(700, 96, seed=5)
    head = GreedyHead.over(weight)
    assert head is not None
    for seed in range(4):
        x = torch.randn(1, 96, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(head.tokens(x), full_argmax(weight, x))


def test_a_greedy_step_of_the_default_model_takes_the_greedy_head():
    """SmolLM2's GGUF ties its head to a Q8_0 embedding: a one-row greedy step's token comes from the greedy
    head and is the argmax of the step's logits; several rows take the logits."""
    from executor_svc.attention.torch_ref import TorchDecode
    from executor_svc.models.loader import load_model
    from protos.model_files import default_model_path

    model = load_model(default_model_path(), "cpu", torch.float32)
    assert model.greedy_head is not None
    kv = model.make_kv_pool(num_pages=8, page_size=16)
    attention = TorchDecode(None, kv, model.scale)
    tables = torch.arange(1, 7, dtype=torch.int32).view(2, 3)
    answered = []  # (rows, whether the greedy head found the tokens) of each greedy step
    tokens_of = model.greedy_head.tokens

    def tokens(x: torch.Tensor) -> torch.Tensor | None:
        found = tokens_of(x)
        answered.append((x.shape[0], found is not None))
        return found

    model.greedy_head.tokens = tokens
    for rows in (1, 2):
        tokens = torch.tensor([504, 3458][:rows])
        for position in range(6):
            kv_lens = torch.full((rows,), position + 1, dtype=torch.int32)
            inputs = attention.over(tokens, kv_lens.long(), kv_lens, tables[:rows])
            greedy = model.forward(inputs, attention, greedy=True)
            assert torch.equal(greedy, model.forward(inputs, attention).argmax(-1))
            tokens = greedy
    assert answered == [(1, True)] * 6 + [(2, False)] * 6
