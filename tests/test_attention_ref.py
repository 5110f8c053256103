"""The torch reference paged attention, and the CPU kernel that reads the pages in place, equal dense causal
SDPA on the same K/V laid out contiguously."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import paged_cpu
from executor_svc.attention.torch_ref import decode_attention, prefill_attention
from executor_svc.kv_pool import KVPool

HEADS, KV_HEADS = 6, 2
# The gathering reference, and the in-place kernel where it builds (a machine without cc skips it).
DECODES = [
    pytest.param(decode_attention, id="gathered"),
    pytest.param(
        paged_cpu.decode_attention,
        id="in-place",
        marks=pytest.mark.skipif(paged_cpu.library() is None, reason="no C compiler for paged_cpu.c"),
    ),
]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """q[n, H, D] at query_positions[n] over k, v[L, KVH, D], causal, GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    visible = torch.arange(k.shape[1])[None, :] <= query_positions[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible).transpose(0, 1)


def _scatter_into_pages(pool: KVPool, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    positions = torch.arange(k.shape[0])
    pool.write(0, pages[positions // pool.page_size], positions % pool.page_size, k, v)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64, 128: the in-place kernel's AVX-512 path
def test_decode_matches_dense(decode, page_size: int, head_dim: int):
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    lengths = [1, 5, page_size, page_size + 1, 3 * page_size + 2, 37]
    width = max(-(-n // page_size) for n in lengths) + 2  # wider than needed: trailing cells stay 0
    pool = KVPool(1, 1 + width * len(lengths), page_size, KV_HEADS, head_dim, torch.float32, "cpu")
    order = torch.randperm(pool.num_pages - 1, generator=gen) + 1  # shuffled pages, never the sink
    block_tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    sequences = []
    for row, length in enumerate(lengths):
        row_pages = order[row * width : (row + 1) * width][: -(-length // page_size)].to(torch.int32)
        block_tables[row, : len(row_pages)] = row_pages
        k = torch.randn(length, KV_HEADS, head_dim, generator=gen)
        v = torch.randn(length, KV_HEADS, head_dim, generator=gen)
        _scatter_into_pages(pool, row_pages, k, v)
        sequences.append((k, v))
    # q with strided rows, as a view into the fused QKV projection is
    q = torch.randn(len(lengths), HEADS + 2 * KV_HEADS, head_dim, generator=gen)[:, :HEADS]
    scale = head_dim**-0.5
    got = decode(q, pool.k[0], pool.v[0], block_tables, torch.tensor(lengths, dtype=torch.int32), scale)
    assert got.shape == q.shape
    for row, (k, v) in enumerate(sequences):
        expected = _dense(q[row : row + 1], k, v, torch.tensor([len(k) - 1]))
        torch.testing.assert_close(got[row : row + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", DECODES)
def test_sink_rows_of_length_one_are_finite_and_leave_real_rows_alone(decode):
    page_size, head_dim = 16, 64
    gen = torch.Generator().manual_seed(7)
    pool = KVPool(1, 4, page_size, KV_HEADS, head_dim, torch.float32, "cpu")
    k = torch.randn(20, KV_HEADS, head_dim, generator=gen)
    v = torch.randn(20, KV_HEADS, head_dim, generator=gen)
    _scatter_into_pages(pool, torch.tensor([3, 1], dtype=torch.int32), k, v)
    q = torch.randn(3, HEADS, head_dim, generator=gen)
    block_tables = torch.tensor([[0, 0], [3, 1], [0, 0]], dtype=torch.int32)
    lengths = torch.tensor([1, 20, 1], dtype=torch.int32)
    got = decode(q, pool.k[0], pool.v[0], block_tables, lengths, head_dim**-0.5)
    assert torch.isfinite(got).all()
    alone = decode(q[1:2], pool.k[0], pool.v[0], block_tables[1:2], lengths[1:2], head_dim**-0.5)
    torch.testing.assert_close(got[1:2], alone)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start", [0, 7, 32])
def test_prefill_matches_dense(page_size: int, head_dim: int, start: int):
    gen = torch.Generator().manual_seed(page_size + head_dim + start)
    n = 21
    total = start + n
    num_pages = -(-total // page_size)
    pool = KVPool(1, 1 + num_pages + 3, page_size, KV_HEADS, head_dim, torch.float32, "cpu")
    pages = (torch.randperm(pool.num_pages - 1, generator=gen)[:num_pages] + 1).to(torch.int32)
    k = torch.randn(total, KV_HEADS, head_dim, generator=gen)
    v = torch.randn(total, KV_HEADS, head_dim, generator=gen)
    _scatter_into_pages(pool, pages, k, v)
    q = torch.randn(n, HEADS, head_dim, generator=gen)
    got = prefill_attention(q, pool.k[0], pool.v[0], pages, start, head_dim**-0.5)
    expected = _dense(q, k, v, torch.arange(start, total))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_pool_write_lands_on_page_and_offset():
    pool = KVPool(2, 5, 4, KV_HEADS, 8, torch.float32, "cpu")
    k = torch.randn(3, KV_HEADS, 8)
    v = torch.randn(3, KV_HEADS, 8)
    pool.write(
        1, torch.tensor([4, 2, 4], dtype=torch.int32), torch.tensor([0, 3, 1], dtype=torch.int32), k, v
    )
    torch.testing.assert_close(pool.k[1, 4, 0], k[0])
    torch.testing.assert_close(pool.k[1, 2, 3], k[1])
    torch.testing.assert_close(pool.v[1, 4, 1], v[2])
    assert pool.k[0].abs().sum() == 0, "other layers are untouched"
    assert pool.nbytes == 2 * 2 * 5 * 4 * KV_HEADS * 8 * 4
