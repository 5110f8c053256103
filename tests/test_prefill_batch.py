"""Packed prefill batches: what PrefillBatch.build lays out, and the model's batched prefill against one chunk
at a time (the torch attention path, on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.models.dense import DenseModel
from executor_svc.prefill.batch import QUERY_BLOCK, PrefillBatch, PrefillShape
from tests.conftest import prefill_forward, tiny_llama_config

PAGE = 4
TINY = tiny_llama_config(intermediate_size=48, eos_token_ids=(1,), bos_token_id=None, name="tiny")


def chunk(ids: list[int], start: int, pages: list[int]) -> tuple[np.ndarray, int, np.ndarray]:
    return np.array(ids, dtype=np.int32), start, np.array(pages, dtype=np.int32)


def test_build_lays_out_tokens_positions_writes_and_tables():
    batch = PrefillBatch.build(
        [chunk([5, 6, 7], 0, [9]), chunk([8, 9], 6, [3, 4])], PAGE, max_seq_len=64, device=torch.device("cpu")
    )
    assert batch.token_ids.tolist() == [5, 6, 7, 8, 9]
    assert batch.positions.tolist() == [0, 1, 2, 6, 7]
    assert batch.write_pages.tolist() == [9, 9, 9, 4, 4]  # positions 6, 7 sit on the second page
    assert batch.write_offsets.tolist() == [0, 1, 2, 2, 3]
    # one empty chunk after the real ones: the padding query blocks of a graph's batch point at it
    assert batch.seq_starts.tolist() == [0, 3, 5, 5]
    assert batch.kv_lens.tolist() == [3, 8, 0]
    assert batch.block_tables.tolist() == [[9, 0], [3, 4], [0, 0]]  # padded with the sink page
    assert batch.last_index.tolist() == [2, 4]
    assert batch.num_tokens == 5
    assert batch.sample_index.tolist() == [] and batch.sampled_chunks.tolist() == []


def test_build_lays_out_query_blocks_and_samples():
    long = chunk(list(range(2, 2 + QUERY_BLOCK + 5)), 0, list(range(1, 1 + -(-(QUERY_BLOCK + 5) // PAGE))))
    batch = PrefillBatch.build(
        [chunk([5, 6, 7], 8, [20, 21, 22]), long],
        PAGE,
        max_seq_len=128,
        device=torch.device("cpu"),
        sample_slots=[0, 7],
    )
    # the shape's bound on blocks leaves one over: it points at the empty chunk after the real ones
    assert batch.block_chunk.tolist() == [0, 1, 1, 2]
    assert batch.block_first.tolist() == [0, 3, 3 + QUERY_BLOCK, 3 + QUERY_BLOCK + 5]
    assert batch.sample_index.tolist() == [3 + QUERY_BLOCK + 4]  # the long chunk's last token
    assert batch.sample_slots.tolist() == [7]
    assert batch.sample_counters.tolist() == [QUERY_BLOCK + 5]  # the position of the token it samples
    assert batch.sampled_chunks.tolist() == [1]


def test_padding_writes_the_sink_and_points_at_the_empty_chunk():
    shape = PrefillShape(tokens=8, chunks=3, samples=2, table_width=4)
    batch = PrefillBatch.build(
        [chunk([5, 6, 7], 0, [9])],
        PAGE,
        max_seq_len=64,
        device=torch.device("cpu"),
        sample_slots=[4],
        shape=shape,
    )
    assert batch.token_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert batch.write_pages.tolist() == [9, 9, 9, 0, 0, 0, 0, 0]  # padding writes the sink page
    assert batch.seq_starts.tolist() == [0, 3, 3, 3, 3]
    assert batch.kv_lens.tolist() == [3, 0, 0, 0]
    assert batch.block_chunk.tolist() == [0, 1, 1, 1]  # shape.blocks = 1 + 3: the rest hold the empty chunk
    assert batch.block_first.tolist() == [0, 3, 3, 3]
    assert batch.sample_slots.tolist() == [4, 0]  # a padding sample loops back into the sink slot
    with pytest.raises(ValueError, match="does not fit the shape"):
        PrefillBatch.build([chunk([1] * 9, 0, [1, 2, 3])], PAGE, 64, torch.device("cpu"), shape=shape)


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([], "at least one chunk"),
        ([chunk([1, 2], 0, [])], "0 pages of 4 cannot hold 2 positions"),
        ([chunk([1] * 5, 0, [1])], "1 pages of 4 cannot hold 5 positions"),
        (
            [chunk([1, 2], 63, list(range(1, 18)))],
            r"positions \[63, 65\) are empty or exceed the context of 64",
        ),
        ([chunk([], 0, [1])], "are empty"),
    ],
)
def test_build_refuses_what_cannot_run(chunks, message):
    with pytest.raises(ValueError, match=message):
        PrefillBatch.build(chunks, PAGE, max_seq_len=64, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny() -> DenseModel:
    torch.manual_seed(0)
    model = DenseModel(TINY, "cpu", torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def test_batched_prefill_equals_one_chunk_at_a_time(tiny: DenseModel):
    """Three sequences in one step, one of them a later chunk over pages written by an earlier step, give the
    logits and the pool contents of running each chunk alone."""
    gen = np.random.default_rng(0)
    a, b, c = (gen.integers(2, 64, size=n).tolist() for n in (11, 5, 14))
    pages = {"a": [7, 2, 9], "b": [4, 11], "c": [1, 13, 6, 15]}
    earlier = chunk(c[:6], 0, pages["c"][:2])
    step = [chunk(a, 0, pages["a"]), chunk(b, 0, pages["b"]), chunk(c[6:], 6, pages["c"])]

    def run(groups: list[list[tuple]]) -> tuple[torch.Tensor, object]:
        kv = tiny.make_kv_pool(num_pages=16, page_size=PAGE)
        logits = [
            prefill_forward(tiny, kv, PrefillBatch.build(group, PAGE, 64, tiny.device)) for group in groups
        ]
        return torch.cat(logits[1:]), kv

    batched, kv_batched = run([[earlier], step])
    alone, kv_alone = run([[earlier]] + [[one] for one in step])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_batched.k, kv_alone.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kv_batched.v, kv_alone.v, atol=1e-6, rtol=1e-6)
    assert batched.shape == (3, TINY.vocab_size)
