"""Park and Restore over real gRPC against a real cache service on disk; the restore guard predicate."""

from __future__ import annotations

import glob
import os
import socket

import grpc
import pytest
import pytest_asyncio
import torch

from cache_svc.server import start_cache_server
from executor_svc.copy_stream import CopyStream
from executor_svc.restore_guard import RESTORE_FIRST_USE_BYTES
from executor_svc.runner import StepRunner
from executor_svc.server import start_executor_server
from executor_svc.slot_store import SlotStore
from executor_svc.snapshot_checks import SnapshotRefused, check_state_slots, shard_ranges
from executor_svc.snapshot_states import LayerKinds, restored_states
from executor_svc.staging_plan import INDEX_BYTES
from protos import cache_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import pack_i32, unpack_i32
from tests.runner_script import BUCKETS, LAYOUT, PAGE, POOL_PAGES, TINY, prefill_chunk, tiny_model

on_session_loop = pytest.mark.asyncio(loop_scope="session")  # the loop the fixtures run on

CACHE_BUDGET = 64 * 1024 * 1024
PROMPT = [5, 17, 3, 40, 22, 9, 11, 60, 2, 31]  # 10 tokens: 3 pages of 4
PARKED_PAGES = [3, 4, 5]
CHECKPOINTS = [
    cache_pb2.Checkpoint(position=4, pinned=True, root=True),
    cache_pb2.Checkpoint(position=10),
]
TENANT, CONVERSATION = "acme", "chat-1"


def make_runner(model, fingerprint: str = "tiny") -> StepRunner:
    store = SlotStore(LAYOUT, model.device, model.config.vocab_size)
    return StepRunner(
        model,
        model.make_kv_pool(POOL_PAGES, PAGE),
        store,
        LAYOUT,
        True,
        buckets=BUCKETS,
        fingerprint=fingerprint,
    )


class Served:
    """An executor server on port 0 and a channel to it; stop() ends both."""

    @classmethod
    async def start(cls, model, cache: str | None, fingerprint: str = "tiny") -> Served:
        served = cls()
        served.runner = make_runner(model, fingerprint)
        # One layer per shard: the tiny model's two layers make two shards, so a shard can go bad alone.
        served.server = await start_executor_server(served.runner, port=0, cache=cache, shard_layers=1)
        served.channel = grpc.aio.insecure_channel(f"127.0.0.1:{served.server.port}")
        served.stub = executor_pb2_grpc.ExecutorStub(served.channel)
        return served

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)

    async def prefill(self, ids: list[int], pages: list[int]) -> None:
        call = self.stub.Steps()
        await call.write(executor_pb2.StepPlan(seq=1, prefill=[prefill_chunk(ids, 0, pages, 0)]))
        await call.read()
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK

    async def park(self, conversation_id: str = CONVERSATION, tenant: str = TENANT, **fields):
        request = dict(token_ids=pack_i32(PROMPT), pages=pack_i32(PARKED_PAGES), checkpoints=CHECKPOINTS)
        request.update(fields)
        return await self.stub.Park(
            executor_pb2.ParkPagesRequest(conversation_id=conversation_id, tenant=tenant, **request)
        )

    async def restore(self, pages: list[int], conversation_id: str = CONVERSATION, tenant: str = TENANT):
        return await self.stub.Restore(
            executor_pb2.RestorePagesRequest(
                conversation_id=conversation_id, tenant=tenant, pages=pack_i32(pages)
            )
        )

    def pages(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.runner.kv_pool
        return pool.k[:, pages].clone(), pool.v[:, pages].clone()

    def whole_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.kv_pool.k.clone(), self.runner.kv_pool.v.clone()


def assert_same_bytes(
    got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]
) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))


async def refused(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert fragment in err.value.details()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest_asyncio.fixture
async def cache(tmp_path):
    """A cache service on tmp_path; `restart()` stops it and serves the same directory on the same port."""

    class Cache:
        async def restart(self) -> None:
            await self.server.stop(None)
            self.server = await start_cache_server(str(tmp_path), CACHE_BUDGET, port=self.port)

    running = Cache()
    running.root = str(tmp_path)
    running.server = await start_cache_server(str(tmp_path), CACHE_BUDGET, port=0)
    running.port = running.server.port
    running.addr = f"127.0.0.1:{running.port}"
    yield running
    await running.server.stop(None)


@pytest_asyncio.fixture
async def parked(model, cache):
    """An executor that prefilled PROMPT into PARKED_PAGES and parked it; the parked K/V alongside."""
    served = await Served.start(model, cache.addr)
    await served.prefill(PROMPT, PARKED_PAGES)
    kv = served.pages(PARKED_PAGES)
    assert kv[0].abs().sum() > 0  # the prefill wrote them
    reply = await served.park()
    page_bytes = 2 * PAGE * TINY.num_kv_heads * TINY.head_dim * 4  # K and V, float32
    assert reply.bytes == TINY.num_layers * len(PARKED_PAGES) * page_bytes
    yield served, kv
    await served.stop()


@on_session_loop
async def test_restore_into_other_pages_is_byte_for_byte_across_a_cache_restart(parked, cache):
    served, kv = parked
    pool = served.runner.kv_pool
    pool.k[:, PARKED_PAGES] = 0  # the planner reuses parked pages
    pool.v[:, PARKED_PAGES] = 0
    before = served.whole_pool()

    destination = [20, 7, 9]
    reply = await served.restore(destination)
    assert_same_bytes(served.pages(destination), kv)
    # No page but the destination's changed.
    others = [p for p in range(POOL_PAGES) if p not in destination]
    assert_same_bytes(served.pages(others), (before[0][:, others], before[1][:, others]))
    assert list(unpack_i32(reply.token_ids)) == PROMPT
    assert list(reply.checkpoints) == CHECKPOINTS

    await cache.restart()
    # Through a staging of one page of one layer at a time (6 chunks here), as a large snapshot goes through
    # the 8 MiB one.
    one_page = 2 * (INDEX_BYTES + 2 * pool.k[0, 0].numel() * pool.k.element_size())
    served.server.servicer.snapshots.copy_stream = CopyStream(pool.k.device, staging_bytes=one_page)
    destination = [30, 1, 2]
    reply = await served.restore(destination)
    assert_same_bytes(served.pages(destination), kv)
    assert list(unpack_i32(reply.token_ids)) == PROMPT and list(reply.checkpoints) == CHECKPOINTS


@on_session_loop
async def test_a_flipped_byte_on_disk_is_data_loss_and_the_pool_is_untouched(parked, cache):
    served, _ = parked
    (blob,) = glob.glob(os.path.join(cache.root, "**", "*-1-2.blob"), recursive=True)  # layer 1's shard
    with open(blob, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    destination = [11, 12, 13]
    served.runner.kv_pool.k[:, destination] = 7.0  # whatever the pages held stays
    before = served.whole_pool()
    await refused(served.restore(destination), grpc.StatusCode.DATA_LOSS, "checksum")
    # The whole snapshot is fetched and checked before the first write: nothing changed at all.
    assert_same_bytes(served.whole_pool(), before)


@on_session_loop
async def test_a_snapshot_of_another_model_is_refused(parked, model, cache):
    other = await Served.start(model, cache.addr, fingerprint="other weights")
    try:
        before = other.whole_pool()
        await refused(other.restore([3, 4, 5]), grpc.StatusCode.FAILED_PRECONDITION, "another model")
        assert_same_bytes(other.whole_pool(), before)
    finally:
        await other.stop()


@on_session_loop
async def test_a_snapshot_in_another_layout_is_refused_and_the_pool_is_untouched(parked):
    """An executor whose pool layout is not the one a snapshot was parked in (a release that changed it, as the
    hybrid's states going value-major in layer-major/2 did) refuses the snapshot by name, before it writes a page.
    The check is the same for every layout; the dense tiny model stands in for the hybrid here."""
    served, _ = parked
    snapshots = served.server.servicer.snapshots
    parked_in, snapshots._layout = snapshots._layout, "kv-then-states-layer-major/1"
    before = served.whole_pool()
    await refused(
        served.restore([3, 4, 5]),
        grpc.StatusCode.FAILED_PRECONDITION,
        f"snapshot layout {parked_in!r}; this executor reads 'kv-then-states-layer-major/1'",
    )
    assert_same_bytes(served.whole_pool(), before)


@on_session_loop
async def test_unknown_conversations_and_other_tenants_are_not_found(parked):
    served, _ = parked
    await refused(served.restore([3, 4, 5], conversation_id="nobody"), grpc.StatusCode.NOT_FOUND, "nobody")
    await refused(served.restore([3, 4, 5], tenant="intruder"), grpc.StatusCode.NOT_FOUND, CONVERSATION)


@on_session_loop
async def test_bad_pages_are_invalid_argument_and_change_nothing(parked):
    served, _ = parked
    before = served.whole_pool()
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    await refused(served.restore([0, 4, 5]), invalid, "sink page")
    await refused(served.restore([3, 4, POOL_PAGES]), invalid, f"page {POOL_PAGES} is outside the pool")
    await refused(served.restore([3, 4, 4]), invalid, "listed twice")
    await refused(served.restore([3, 4]), invalid, "the snapshot holds 3 pages; 2 destination pages given")
    await refused(served.restore([]), invalid, "no pages given")
    await refused(served.park(pages=pack_i32([3, 4])), invalid, "10 tokens fill 3 pages of 4; 2 pages given")
    await refused(
        served.park(checkpoints=[cache_pb2.Checkpoint(position=11)]),
        invalid,
        "strictly increasing",
    )
    await refused(served.park(token_ids=b""), invalid, "nothing to park")
    # Ids a resume could not read again: every later turn of the conversation would be refused.
    bad_id = pack_i32([5, 7, 3, 40, 22, 9, 11, 60, 2, 64])
    await refused(served.park(token_ids=bad_id), invalid, "token id 64 is outside the vocabulary (64)")
    too_long = dict(token_ids=pack_i32([1] * 65), pages=pack_i32(range(1, 18)), checkpoints=[])
    await refused(served.park(**too_long), invalid, "65 tokens, more than the context holds (64)")
    assert_same_bytes(served.whole_pool(), before)


@on_session_loop
async def test_without_a_cache_park_and_restore_are_refused(model):
    served = await Served.start(model, cache=None)
    try:
        no_cache = grpc.StatusCode.FAILED_PRECONDITION
        await refused(served.park(), no_cache, "no cache service configured")
        await refused(served.restore([3, 4, 5]), no_cache, "no cache service configured")
    finally:
        await served.stop()


@on_session_loop
async def test_a_cache_that_is_down_is_unavailable(model):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{probe.getsockname()[1]}"
    served = await Served.start(model, cache=addr)
    try:
        await served.prefill(PROMPT, PARKED_PAGES)
        await refused(served.park(), grpc.StatusCode.UNAVAILABLE, f"cache service at {addr} unreachable")
        await refused(served.restore([3, 4, 5]), grpc.StatusCode.UNAVAILABLE, "unreachable")
    finally:
        await served.stop()


def test_shard_ranges_cut_at_multiples_of_the_shard_size():
    assert shard_ranges(0, 30, 8) == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert shard_ranges(0, 2, 8) == [(0, 2)]
    assert shard_ranges(0, 2, 1) == [(0, 1), (1, 2)]
    assert shard_ranges(10, 20, 8) == [(10, 16), (16, 20)]  # a layer split's part
    with pytest.raises(ValueError):
        shard_ranges(4, 4, 8)


def test_a_hybrid_shard_maps_its_layers_to_each_pool():
    kinds = LayerKinds(frozenset({0, 1, 2, 4, 5, 6}))  # R R R A R R R A
    assert kinds.pattern(8) == "RRRARRRA"
    assert (kinds.kv_range(0, 2), kinds.state_range(0, 2)) == ((0, 0), (0, 2))  # recurrent layers only
    assert (kinds.kv_range(2, 4), kinds.state_range(2, 4)) == ((0, 1), (2, 3))
    assert (kinds.kv_range(4, 8), kinds.state_range(4, 8)) == ((1, 2), (3, 6))
    dense = LayerKinds(frozenset(), first=10)  # a layer split's second half: every layer KV
    assert (dense.kv_range(12, 16), dense.state_range(12, 16), dense.kv_count(8, 12)) == ((2, 6), (0, 0), 4)


def test_a_restore_short_of_state_slots_brings_the_pins_state_back_and_the_newest():
    """Retention never evicts a pin: a restore given fewer state slots than checkpoints parked keeps the pin's
    state first, then the newest others' (the next turn resumes from the newest)."""
    assert restored_states([False, True, False, False], 4) == [0, 1, 2, 3]  # every one: slots suffice
    assert restored_states([False, True, False, False], 9) == [0, 1, 2, 3]
    assert restored_states([False, True, False, False], 1) == [1]  # the pin, not the newest
    assert restored_states([False, True, False, False], 2) == [1, 3]
    assert restored_states([False, False, True], 2) == [1, 2]  # the pin is the newest
    assert restored_states([False, False, False], 2) == [1, 2]  # no pin: the newest
    assert restored_states([True, False], 0) == [] and restored_states([], 3) == []


def test_state_slots_of_a_park_or_restore_are_checked():
    assert check_state_slots(pack_i32([3, 1]), 5, 2).tolist() == [3, 1]
    assert check_state_slots(b"", 0, 2).tolist() == []  # a model without recurrent layers sends none
    for data, slots, expected, message in (
        (pack_i32([1]), 0, None, "state_slots given for a model without recurrent layers"),
        (pack_i32([1]), 5, 2, "2 checkpoints need one state slot each; 1 state slots given"),
        (pack_i32([0]), 5, None, "state slot 0 is outside [1, 5) (0 is the sink slot)"),
        (pack_i32([2, 2]), 5, None, "a state slot is listed twice"),
        (b"abc", 5, None, "3 bytes is not a multiple of 4"),
    ):
        with pytest.raises(SnapshotRefused) as refused:
            check_state_slots(data, slots, expected)
        assert message in str(refused.value) and refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


@on_session_loop
async def test_a_refused_restore_writes_nothing_and_leaves_the_snapshot(parked, model, cache):
    """The restore guard over gRPC: a fresh executor (no copy stream yet) on a nearly full card refuses with
    RESOURCE_EXHAUSTED and the pool untouched; the snapshot stays in the cache and restores once there is
    room; with its stream made, a full card is never refused."""
    _, kv = parked
    served = await Served.start(model, cache=cache.addr)
    try:
        free = [1 << 20]
        served.server.servicer.snapshots.copy_stream.free_memory = lambda: free[0]
        before = served.whole_pool()
        await refused(served.restore(PARKED_PAGES), grpc.StatusCode.RESOURCE_EXHAUSTED, "cpu has 1 MiB free")
        assert_same_bytes(served.whole_pool(), before)
        free[0] = RESTORE_FIRST_USE_BYTES
        await served.restore(PARKED_PAGES)
        assert_same_bytes(served.pages(PARKED_PAGES), kv)
        free[0] = 0
        await served.restore([7, 8, 9])
        assert_same_bytes(served.pages([7, 8, 9]), kv)
    finally:
        await served.stop()
