"""The Triton paged prefill attention against the torch reference, chunk by chunk, under TRITON_INTERPRET=1 on
the CPU unless TRITON_INTERPRET=0 picks the GPU; and the model's batched prefill through it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import interpreting, triton_available

if not triton_available():
    pytest.skip("triton cannot run here: no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from executor_svc.attention.torch_ref import prefill_attention_batch
from executor_svc.kernels.prefill_attention import BLOCK_M, paged_prefill_attention
from executor_svc.kv_pool import KVPool
from executor_svc.prefill.batch import PrefillBatch, PrefillShape
from tests.conftest import prefill_forward, tiny_llama_config
from tests.test_kernels import tolerance

DEVICE = torch.device("cpu" if interpreting() else "cuda")
HEADS, KV_HEADS = 9, 3  # SmolLM2's GQA 3:1
POOL_PAGES = 40


def random_chunks(page_size: int, seed: int) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Three chunks: a whole short prompt, a later chunk of a long one (its start in the middle of a page, its
    first positions written before), and a chunk longer than one query block."""
    gen = np.random.default_rng(seed)
    order = gen.permutation(np.arange(1, POOL_PAGES))  # non-contiguous pages, never the sink
    shapes = [(0, 7), (page_size + 3, 9), (2, BLOCK_M + 5)]  # (start, length)
    chunks, used = [], 0
    for start, length in shapes:
        count = -(-(start + length) // page_size)
        chunks.append((gen.integers(0, 100, size=length).astype(np.int32), start, order[used : used + count]))
        used += count
    return chunks


def random_batch(page_size: int, seed: int) -> PrefillBatch:
    return PrefillBatch.build(random_chunks(page_size, seed), page_size, max_seq_len=4096, device=DEVICE)


@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])  # 256: the wide heads' own tiles
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("tiles", [None, (16, 4, 1), (128, 8, 4)])
def test_paged_prefill_attention_matches_the_reference(page_size: int, head_dim: int, tiles):
    if tiles and (head_dim, page_size) != (64, 16):
        pytest.skip("other tiles at one shape")
    batch = random_batch(page_size, seed=page_size + head_dim)
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(1, POOL_PAGES, page_size, KV_HEADS, head_dim, torch.float32, DEVICE)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    q = torch.randn(batch.num_tokens, HEADS, head_dim, generator=gen).to(DEVICE)
    scale = head_dim**-0.5
    got = paged_prefill_attention(q, pool.k[0], pool.v[0], batch, scale, tiles=tiles)
    expected = prefill_attention_batch(q, pool.k[0], pool.v[0], batch, scale)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


def test_paged_prefill_attention_in_bfloat16():
    batch = random_batch(16, seed=3)
    gen = torch.Generator().manual_seed(2)
    pool = KVPool(1, POOL_PAGES, 16, KV_HEADS, 64, torch.bfloat16, DEVICE)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    q = torch.randn(batch.num_tokens, HEADS, 64, generator=gen).to(DEVICE, torch.bfloat16)
    got = paged_prefill_attention(q, pool.k[0], pool.v[0], batch, 0.125)
    expected = prefill_attention_batch(q.float(), pool.k[0].float(), pool.v[0].float(), batch, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, **tolerance(torch.bfloat16))


def test_refuses_mismatched_shapes():
    batch = random_batch(4, seed=0)
    pool = KVPool(1, POOL_PAGES, 4, KV_HEADS, 64, torch.float32, DEVICE)
    q = torch.zeros(batch.num_tokens + 1, HEADS, 64, device=DEVICE)
    with pytest.raises(ValueError, match="tokens"):
        paged_prefill_attention(q, pool.k[0], pool.v[0], batch, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        paged_prefill_attention(q[:, :8], pool.k[0], pool.v[0], batch, 0.125)
    with pytest.raises(ValueError, match="tiles must hold"):
        paged_prefill_attention(q[:-1], pool.k[0], pool.v[0], batch, 0.125, tiles=(48, 4, 2))


def small_model(**overrides):
    from executor_svc.models.dense import DenseModel

    config = tiny_llama_config(
        vocab_size=100,
        hidden_size=64,
        num_heads=6,
        head_dim=16,
        intermediate_size=96,
        max_seq_len=4096,
        eos_token_ids=(1,),
        bos_token_id=None,
        name="small",
        **overrides,
    )
    torch.manual_seed(0)
    model = DenseModel(config, DEVICE, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


# Plain Llama; and Qwen3's q/k head norms with biases in every projection (the many-row GEMM path of each).
@pytest.mark.parametrize("variant", [{}, dict(qk_norm=True, attention_bias=True, mlp_bias=True)])
def test_fused_prefill_equals_the_torch_path(variant: dict):
    model = small_model(**variant)
    batch = random_batch(4, seed=5)
    eager_kv = model.make_kv_pool(num_pages=POOL_PAGES, page_size=4)
    fused_kv = model.make_kv_pool(num_pages=POOL_PAGES, page_size=4)
    eager = prefill_forward(model, eager_kv, batch)
    fused = prefill_forward(model, fused_kv, batch, fused=True)
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_kv.k, eager_kv.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_kv.v, eager_kv.v, atol=1e-5, rtol=1e-5)


def test_a_padded_batch_computes_what_the_exact_one_does():
    """A graph's batch: the same chunks padded with tokens, chunks, samples and table columns give the same
    logits for the sampling chunks and the same pages, but for the sink page the padding writes."""
    model = small_model()
    chunks = random_chunks(4, seed=7)
    slots = [3, 0, 5]  # the middle chunk does not end its prompt
    exact = PrefillBatch.build(chunks, 4, 4096, DEVICE, sample_slots=slots)
    shape = PrefillShape(tokens=exact.num_tokens + 50, chunks=6, samples=4, table_width=40)
    padded = PrefillBatch.build(chunks, 4, 4096, DEVICE, sample_slots=slots, shape=shape)
    assert padded.token_ids.shape == (shape.tokens,) and padded.block_chunk.shape == (shape.blocks,)
    assert padded.sample_slots.tolist() == [3, 5, 0, 0]
    results = []
    for batch in (exact, padded):
        kv = model.make_kv_pool(num_pages=POOL_PAGES, page_size=4)
        logits = prefill_forward(model, kv, batch, fused=True, select=batch.sample_index)
        assert torch.isfinite(kv.k).all() and torch.isfinite(kv.v).all()
        results.append((logits, kv))
    (exact_logits, exact_kv), (padded_logits, padded_kv) = results
    torch.testing.assert_close(padded_logits[:2], exact_logits, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded_logits).all()  # the padding samples too (they read token 0's logits)
    torch.testing.assert_close(padded_kv.k[:, 1:], exact_kv.k[:, 1:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(padded_kv.v[:, 1:], exact_kv.v[:, 1:], atol=1e-6, rtol=1e-6)


def test_padding_tokens_attend_to_nothing_and_get_zeros():
    chunks = random_chunks(16, seed=4)
    exact = PrefillBatch.build(chunks, 16, 4096, DEVICE)
    shape = PrefillShape(tokens=exact.num_tokens + 70, chunks=5, samples=1, table_width=12)
    padded = PrefillBatch.build(chunks, 16, 4096, DEVICE, shape=shape)
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, POOL_PAGES, 16, KV_HEADS, 64, torch.float32, DEVICE)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    q = torch.randn(shape.tokens, HEADS, 64, generator=gen).to(DEVICE)
    real = exact.num_tokens
    got = paged_prefill_attention(q, pool.k[0], pool.v[0], padded, 0.125)
    expected = paged_prefill_attention(q[:real], pool.k[0], pool.v[0], exact, 0.125)
    torch.testing.assert_close(got[:real], expected, **tolerance(torch.float32))
    assert not got[real:].any()
