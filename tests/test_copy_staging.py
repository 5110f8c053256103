"""Park and restore through the copy stream's fixed-size staging: the chunk plan alone, the staging's size
whatever the snapshot, and the chunked copies bit for bit against the pool for snapshots many times the
staging, parked under one layer split and restored under others (the real shard copies on the CPU), a hybrid's
recurrent states with its pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.copy_stream import CopyStream
from executor_svc.kv_pool import KVPool
from executor_svc.restore_guard import STAGING_BYTES
from executor_svc.shard_copies import read_shards, write_shards
from executor_svc.snapshot_checks import shard_ranges
from executor_svc.snapshot_states import LayerKinds, StateShards
from executor_svc.staging_plan import INDEX_BYTES, plan_chunks
from executor_svc.state_pool import StatePool

CPU = torch.device("cpu")
LAYERS, PAGES, SHARD_LAYERS = 6, 40, 4
PAGE_SHAPE = (4, 2, 8)  # page_size, kv_heads, head_dim: 128 bytes of bf16 per page of K (or V) of a layer
PARKED = np.array([7, 3, 30, 12, 5, 21, 33, 8, 9, 14, 2, 27, 39], dtype=np.int32)  # 13 pages, out of order
RESTORED = np.array([1, 2, 3, 4, 5, 6, 10, 11, 16, 17, 18, 19, 20], dtype=np.int32)
# Staging sizes: a page of a layer a chunk, runs of pages within a layer, one layer, all layers at once.
STAGINGS = (600, 3000, 8192, STAGING_BYTES)
SPLITS = ([(0, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 5), (5, 6)], [(0, 2), (2, 4), (4, 6)])


@pytest.mark.parametrize(
    ("layers", "entries", "entry_bytes", "capacity"),
    [
        (30, 13, 12288, 4 << 20),
        (30, 2000, 12288, 4 << 20),
        (6, 13, 256, 296),
        (6, 13, 256, 1496),
        (1, 1, 8, 16),
    ],
)
def test_chunks_cover_the_copy_once_each_within_the_staging(layers, entries, entry_bytes, capacity):
    chunks = plan_chunks(layers, entries, entry_bytes, capacity)
    covered = np.zeros((layers, entries), dtype=int)
    for chunk in chunks:
        assert 0 < chunk.nbytes(entry_bytes) <= capacity
        covered[chunk.l0 : chunk.l1, chunk.e0 : chunk.e1] += 1
    assert (covered == 1).all()


def test_chunk_plans_say_what_does_not_fit():
    assert plan_chunks(4, 0, 100, 1000) == [] and plan_chunks(0, 4, 100, 1000) == []
    assert len(plan_chunks(30, 13, 12288, 4 << 20)) == 2  # whole layers: 26 at once, then 4
    assert len(plan_chunks(2, 1000, 100, 1080)) == 200  # runs of 10 pages of one layer
    with pytest.raises(ValueError, match="does not fit the 100-byte staging"):
        plan_chunks(2, 3, 100 - INDEX_BYTES + 1, 100)


def random_pool(layers: int = LAYERS, seed: int = 0) -> KVPool:
    pool = KVPool(layers, PAGES, *PAGE_SHAPE, dtype=torch.bfloat16, device=CPU)
    generator = torch.Generator().manual_seed(seed)
    for tensor in (pool.k, pool.v):  # every bit pattern but NaNs' differences: compared as bytes
        tensor.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, tensor.shape, generator=generator))
    return pool


def park(pools: list[KVPool], split: list[tuple[int, int]], staging: int) -> tuple[list, list[bytes]]:
    """Every stage's shards of the parked pages, in layer order, as the first stage puts them."""
    shards, blobs = [], []
    for pool, (begin, end) in zip(pools, split, strict=True):
        ranges = shard_ranges(begin, end, SHARD_LAYERS)
        shards += ranges
        blobs += read_shards(CopyStream(CPU, staging_bytes=staging), pool, begin, ranges, PARKED)
    return shards, blobs


def stage_pools(whole: KVPool, split: list[tuple[int, int]]) -> list[KVPool]:
    """The stages' pools of a split, holding the whole pool's pages of their layers."""
    pools = []
    for begin, end in split:
        pool = KVPool(end - begin, PAGES, *PAGE_SHAPE, dtype=torch.bfloat16, device=CPU)
        pool.k.copy_(whole.k[begin:end])
        pool.v.copy_(whole.v[begin:end])
        pools.append(pool)
    return pools


@pytest.mark.parametrize("staging", STAGINGS)
def test_chunked_park_and_restore_are_bit_equal_across_splits(staging):
    whole = random_pool()
    expected = (whole.k[:, PARKED].view(torch.int16), whole.v[:, PARKED].view(torch.int16))
    # The shards as one copy of each would read them: layer by layer, K then V.
    reference = [
        torch.stack((whole.k[b:e, PARKED], whole.v[b:e, PARKED]), dim=1).view(torch.uint8).numpy().tobytes()
        for b, e in shard_ranges(0, LAYERS, SHARD_LAYERS)
    ]
    for parked_under in SPLITS:
        shards, blobs = park(stage_pools(whole, parked_under), parked_under, staging)
        assert staging == STAGING_BYTES or sum(map(len, blobs)) > 2 * staging  # larger than the staging
        if parked_under == SPLITS[0]:
            assert blobs == reference
        for restored_under in SPLITS:
            for pool, (begin, end) in zip(stage_pools(random_pool(seed=1), restored_under), restored_under):
                # What the cache gives a stage: the shards that reach into its layers.
                mine = [(s, b) for s, b in zip(shards, blobs, strict=True) if s[0] < end and s[1] > begin]
                stream = CopyStream(CPU, staging_bytes=staging)
                write_shards(stream, pool, (begin, end), [s for s, _ in mine], [b for _, b in mine], RESTORED)
                assert pool.k[:, RESTORED].view(torch.int16).equal(expected[0][begin:end])
                assert pool.v[:, RESTORED].view(torch.int16).equal(expected[1][begin:end])


def test_the_staging_is_made_once_and_its_size_is_the_same_whatever_the_snapshot():
    stream = CopyStream(CPU, staging_bytes=3000)
    assert not stream.ready and stream.staging_nbytes <= 3000
    small, large = random_pool(layers=1), random_pool(seed=2)
    stream.scatter((small.k,), np.zeros((1, 1, 1, 128), dtype=np.uint8), np.array([1]))
    assert stream.ready
    halves = [(half.data_ptr(), half.numel()) for half in stream._card]
    assert sum(size for _, size in halves) == stream.staging_nbytes
    every_page = np.arange(1, PAGES)
    parked = stream.gather((large.k, large.v), every_page)  # 60 KiB, 20 times the staging
    assert parked.nbytes > 20 * stream.staging_nbytes
    stream.scatter((large.k, large.v), parked, every_page[::-1].copy())
    assert [(half.data_ptr(), half.numel()) for half in stream._card] == halves
    reversed_pages = large.k[:, 1:].flip(1).view(torch.int16)
    assert reversed_pages.equal(random_pool(seed=2).k[:, 1:].view(torch.int16))


def test_a_hybrids_states_and_pages_restore_bit_equal_across_splits():
    """A hybrid's shards (K/V of its full-attention layers, then the states of its gated delta nets) parked by
    the stages of one split and restored by those of another, stages with no layers of a kind included; a state
    chosen alone (a restore short of slots) lands bit-equal too."""
    kinds = LayerKinds(frozenset({0, 1, 3, 4}))  # R R A R R A
    parked_slots, restored_slots = np.array([4, 2]), np.array([1, 3])
    whole_kv = random_pool(layers=2)
    whole_states = StatePool(4, 5, 6, 4, 2, 4, 4, dtype=torch.bfloat16, device=CPU)
    generator = torch.Generator().manual_seed(3)
    whole_states.conv.view(torch.int16).copy_(
        torch.randint(-9999, 9999, whole_states.conv.shape, generator=generator)
    )
    whole_states.recurrent.normal_(generator=generator)

    def stage(begin: int, end: int, source: bool) -> tuple[KVPool, StateShards, LayerKinds]:
        """A stage's pools: holding the whole's layers (`source`), or zeros."""
        mine = LayerKinds(kinds.recurrent, begin)
        kv = KVPool(mine.kv_count(begin, end), PAGES, *PAGE_SHAPE, dtype=torch.bfloat16, device=CPU)
        low, high = kinds.state_range(begin, end)
        states = StatePool(high - low, 5, 6, 4, 2, 4, 4, dtype=torch.bfloat16, device=CPU)
        if source:
            first, last = kinds.kv_range(begin, end)
            kv.k.copy_(whole_kv.k[first:last]), kv.v.copy_(whole_kv.v[first:last])
            states.conv.copy_(whole_states.conv[low:high])
            states.recurrent.copy_(whole_states.recurrent[low:high])
        return kv, StateShards(states, mine), mine

    splits = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 5), (5, 6)])  # stages without KV, without states
    stream = CopyStream(CPU, staging_bytes=3000)
    for parked_under in splits:
        shards, blobs = [], []
        for begin, end in parked_under:
            kv, states, mine = stage(begin, end, source=True)
            ranges = shard_ranges(begin, end, SHARD_LAYERS)
            pages = read_shards(stream, kv, begin, ranges, PARKED, mine)
            shards += ranges
            blobs += [p + states.read(stream, *r, parked_slots) for p, r in zip(pages, ranges, strict=True)]
        for restored_under in splits:
            for begin, end in restored_under:
                kv, states, mine = stage(begin, end, source=False)
                got = [(s, b) for s, b in zip(shards, blobs, strict=True) if s[0] < end and s[1] > begin]
                page_bytes = [mine.kv_count(*s) * 2 * len(PARKED) * 128 for s, _ in got]
                write_shards(
                    stream,
                    kv,
                    (begin, end),
                    [s for s, _ in got],
                    [b[:n] for (_, b), n in zip(got, page_bytes)],
                    RESTORED,
                    mine,
                )
                for (s, b), n in zip(got, page_bytes, strict=True):
                    blob = np.frombuffer(b, dtype=np.uint8)[n:]
                    states.write(stream, (begin, end), *s, blob, len(parked_slots), restored_slots, [0, 1])
                    # One slot only, for the older state (a pin's): chosen by index, not the newest.
                    states.write(stream, (begin, end), *s, blob, len(parked_slots), np.array([2]), [0])
                first, last = kinds.kv_range(begin, end)
                assert (
                    kv.k[:, RESTORED]
                    .view(torch.int16)
                    .equal(whole_kv.k[first:last, PARKED].view(torch.int16))
                )
                assert (
                    kv.v[:, RESTORED]
                    .view(torch.int16)
                    .equal(whole_kv.v[first:last, PARKED].view(torch.int16))
                )
                low, high = kinds.state_range(begin, end)
                pool = states.pool
                assert pool.conv[:, restored_slots].equal(whole_states.conv[low:high, parked_slots])
                assert pool.recurrent[:, restored_slots].equal(whole_states.recurrent[low:high, parked_slots])
                assert pool.conv[:, 2].equal(whole_states.conv[low:high, parked_slots[0]])
                assert pool.recurrent[:, 2].equal(whole_states.recurrent[low:high, parked_slots[0]])
