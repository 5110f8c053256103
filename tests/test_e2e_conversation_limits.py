"""Conversations over the real stack with the cache service at its limits, each on a stack of its own: the
cache down (generation works, parking is refused), the cache full (a resumed conversation's spare copy
evicted before a parked one's only one), and the KV pool short (idle conversations parked for a resume,
the coldest parked under pressure) (issue 4)."""

from __future__ import annotations

import grpc
import pytest

from planner_svc.client import GenerateOptions, PlannerClient
from protos import client_pb2
from tests.cached_stack import PAGE, SYSTEM, CachedStack, turn

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_cache_down_generation_works_and_parking_is_refused(tmp_path):
    stack = CachedStack(str(tmp_path))
    await stack.start()
    try:
        await stack.servers[-1].stop(None)  # the cache goes away
        chat = [SYSTEM, {"role": "user", "content": "Count to three."}]
        async with PlannerClient(stack.stack.addr) as client:
            tokens, done = await turn(client, chat, "nocache")
            assert tokens and done.finish_reason in (1, 2)
            await stack.stack.wait_idle()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client._stub.Park(client_pb2.ParkRequest(conversation_id="nocache"))
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
            assert (
                "cache" in caught.value.details().lower() or "unavailable" in caught.value.details().lower()
            )
            # nothing changed: the conversation still holds its pages and continues from them
            conversation = stack.stack.scheduler.conversations.get("default", "nocache")
            assert conversation.pages and not conversation.parked
    finally:
        await stack.stop()


async def test_a_full_cache_evicts_a_resumed_conversations_spare_copy_before_a_parked_ones_only_one(tmp_path):
    """A cache with room for two snapshots: park A, park B, resume B (its pages back in the pool, its snapshot a
    spare), park C. C's put evicts B's spare, not A's only copy, so A still resumes (it used to be evicted, the
    least recently used, and its KV lost)."""
    stack = CachedStack(str(tmp_path), cache_bytes=5_000_000)  # a snapshot here is ~2.2 MB
    await stack.start()
    try:
        s = stack.stack
        async with PlannerClient(s.addr) as client:
            for name in ("A", "B", "C"):
                await turn(
                    client, [SYSTEM, {"role": "user", "content": f"Conversation {name}: a fact."}], name
                )
                await s.wait_idle()
                if name != "C":
                    await client.park(name)
            await client.resume("B")
            await client.park("C")
            resumed = await client.resume("A")
            assert resumed.tokens == len(s.scheduler.conversations.get("default", "A").tokens)
            assert s.scheduler.conversations.get("default", "B").pages  # B lives on in the pool
    finally:
        await stack.stop()


async def test_a_resume_short_of_pages_parks_idle_conversations_first(tmp_path):
    """A parked conversation resumed while idle ones hold the pages it needs: the coldest idle ones are
    parked to make room (as KV pressure parks them), and it is restored instead of reading its prompt again."""
    stack = CachedStack(str(tmp_path), pool_pages=120)
    await stack.start()
    try:
        s = stack.stack
        async with PlannerClient(s.addr) as client:
            await turn(client, [SYSTEM, {"role": "user", "content": "Big chat " * 570}], "big", max_tokens=2)
            await s.wait_idle()
            await client.park("big")
            for name in ("idle-1", "idle-2"):
                await turn(
                    client, [SYSTEM, {"role": "user", "content": f"{name} " * 150}], name, max_tokens=2
                )
            await s.wait_idle()
            big = s.scheduler.conversations.get("default", "big")
            need = -(-len(big.tokens) // PAGE)
            assert s.scheduler.pages.free_count < need, "the test needs a pool short of the snapshot"
            resumed = await client.resume("big")
            assert resumed.tokens == len(big.tokens) and big.pages
            assert s.scheduler.conversations.get("default", "idle-1").parked
    finally:
        await stack.stop()


async def test_kv_pressure_parks_the_coldest_conversation(tmp_path):
    stack = CachedStack(str(tmp_path), pool_pages=120)
    await stack.start()
    try:
        s = stack.stack
        async with PlannerClient(s.addr) as client:
            await turn(
                client, [SYSTEM, {"role": "user", "content": "First chat " * 200}], "cold", max_tokens=2
            )
            await s.wait_idle()
            cold = s.scheduler.conversations.get("default", "cold")
            assert cold.pages
            big = await client.generate_all(
                GenerateOptions(token_ids=[5 + i % 40 for i in range(1500)], max_tokens=4)
            )
            assert big.finish_reason == "length"
            assert cold.parked and not cold.pages
            _, done = await turn(
                client,
                [
                    SYSTEM,
                    {"role": "user", "content": "First chat " * 200},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "again"},
                ],
                "cold",
                max_tokens=2,
            )
            assert done.checkpoint.startswith("snapshot@") and done.reused_tokens > 0
    finally:
        await stack.stop()
