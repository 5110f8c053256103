"""Deleting a conversation over the real stack (SmolLM2 on the CPU, the cache service on a temporary directory,
gRPC and the HTTP gateway on loopback): its pages go back exactly, its snapshot leaves the cache, the planner
keeps no record of it, and the next turn of its id starts fresh; another tenant's, an unknown or a malformed
id and a turn in flight are refused, changing nothing."""

from __future__ import annotations

import os

import grpc
import httpx2 as httpx
import pytest
import pytest_asyncio

from cache_svc.client import CacheClient
from cache_svc.manifest import snapshot_key
from planner_svc.client import Deleted, PlannerClient
from planner_svc.drain import DRAINING
from protos import client_pb2
from protos.wire import pack_i32
from tests.cached_stack import PAGE, CachedStack, reply, turn
from tests.chat_streams import streaming_turn

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Deleting:
    def __init__(self, cached: CachedStack, http_base: str) -> None:
        self.cached, self.stack, self.http_base = cached, cached.stack, http_base

    def snapshot_files(self, conversation_id: str, tenant: str = "default") -> list[str]:
        """The files of its snapshot on disk (a deleted one leaves its empty directory to the next start)."""
        directory = os.path.join(self.cached.cache_dir, "snapshots", snapshot_key(tenant, conversation_id))
        return os.listdir(directory) if os.path.isdir(directory) else []


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deleting(tmp_path_factory):
    from gateway_svc.http_server import start_gateway

    cached = CachedStack(str(tmp_path_factory.mktemp("cache")))
    await cached.start()
    gateway = await start_gateway(cached.stack.addr)
    yield Deleting(cached, f"http://127.0.0.1:{gateway.port}")
    await gateway.stop()
    await cached.stop()


def recorded(stack, conversation_id: str, tenant: str = "default") -> list[str]:
    """Where the planner still keeps a record of the conversation."""
    key = (tenant, conversation_id)
    turns = stack.planner.turns
    places = {
        "conversations": any(e.conversations.get(*key) is not None for e in stack.planner.engines),
        "locks": key in turns._locks,
        "latest turns": key in turns._latest,
    }
    return [place for place, held in places.items() if held]


async def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details()


def chat_of(subject: str) -> list[dict[str, str]]:
    """A chat no other test's prompt starts like (no page of it is shared through the prefix index)."""
    return [
        {"role": "system", "content": f"You only talk about {subject}."},
        {"role": "user", "content": f"Tell me one thing about {subject}."},
    ]


async def test_delete_gives_back_pages_and_the_snapshot_and_the_id_starts_fresh(deleting):
    stack = deleting.stack
    scheduler = stack.scheduler
    chat = chat_of("rivers")
    async with PlannerClient(stack.addr) as client:
        await stack.wait_idle()
        free_before, info_before = scheduler.pages.free_count, await client.server_info()
        first, _ = await turn(client, chat, "gone")
        await stack.wait_idle()
        await client.park("gone")
        await client.resume("gone")  # back in the pool, its snapshot still in the cache
        chat2 = chat + [
            {"role": "assistant", "content": reply(stack, first)},
            {"role": "user", "content": "And another?"},
        ]
        await turn(client, chat2, "gone")
        await stack.wait_idle()
        conversation = scheduler.conversations.get("default", "gone")
        held = (len(conversation.tokens), len(conversation.pages))
        assert held[1] and deleting.snapshot_files("gone")

        deleted = await client.delete_conversation("gone")

        assert (deleted.tokens, deleted.pages) == held and deleted.snapshot_bytes > 0
        scheduler.pages.check()
        assert scheduler.pages.free_count == free_before
        assert (await client.server_info()).free_pages == info_before.free_pages
        assert "gone" not in [c.conversation_id for c in await client.conversations()]
        assert deleting.snapshot_files("gone") == []
        assert recorded(stack, "gone") == []
        await refused(client.park("gone"), grpc.StatusCode.NOT_FOUND)
        await refused(client.delete_conversation("gone"), grpc.StatusCode.NOT_FOUND)
        # The same id again: a new conversation, no checkpoint or snapshot of the old one (its pages, free, stay
        # in the tenant's prefix index: it reads from them as any prompt of the tenant would), with the tokens of
        # a read of a prompt never seen.
        again, done = await turn(client, chat2, "gone")
        assert (done.checkpoint, done.diverged_at) == ("prefix", -1)
        fresh, _ = await turn(client, chat2)
        assert again == fresh
        await stack.wait_idle()
        assert (await client.delete_conversation("gone")).snapshot_bytes == 0  # never parked this time
    scheduler.pages.check()
    assert scheduler.pages.free_count == free_before


async def test_a_prefix_the_tenants_conversations_share_stays_reusable_and_only_freed_pages_count(deleting):
    """Deleting a conversation frees its pages but leaves them in the tenant's prefix index: a system prompt its
    other conversations share is still reused (it was taken out of the index whenever one of them was deleted
    while no request held it), and `pages` counts the pages freed, not those another conversation holds."""
    stack = deleting.stack
    scheduler = stack.scheduler
    system = {"role": "system", "content": "You are a terse guide. " + "Answer in one line, plainly. " * 12}
    asks = [[system, {"role": "user", "content": f"Name one {thing}."}] for thing in ("bird", "tree", "fish")]
    async with PlannerClient(stack.addr) as client:
        await stack.wait_idle()
        await turn(client, asks[0], "shared-1")
        _, second = await turn(client, asks[1], "shared-2")
        shared = second.reused_tokens
        assert shared >= 4 * PAGE, "the second conversation reused the first's system prompt pages"
        await stack.wait_idle()
        first_pages = set(scheduler.conversations.get("default", "shared-1").pages)
        second_pages = scheduler.conversations.get("default", "shared-2").pages

        deleted = await client.delete_conversation("shared-2")  # the first still holds the shared pages
        assert deleted.pages == len(set(second_pages) - first_pages) < len(second_pages)
        await client.delete_conversation("shared-1")  # now no one holds them

        _, third = await turn(client, asks[2], "shared-3")
        assert third.reused_tokens == shared, "a new conversation still reuses the tenant's system prompt"
        await stack.wait_idle()
        await client.delete_conversation("shared-3")
    scheduler.pages.check()


async def test_a_turn_streaming_is_refused_and_one_that_answered_is_waited_for(deleting):
    stack = deleting.stack
    scheduler = stack.scheduler
    request = client_pb2.GenerateRequest(
        token_ids=pack_i32([300 + i for i in range(40)]),
        max_tokens=300,
        ignore_eos=True,
        conversation_id="busy",
        request_id="busy-turn",
    )
    async with PlannerClient(stack.addr) as client:
        await stack.wait_idle()
        free_before = scheduler.pages.free_count
        call = client._stub.Generate(request)
        assert (await call.read()) is not grpc.aio.EOF
        free_running = scheduler.pages.free_count  # every page the turn can write was taken at admission
        said = await refused(client.delete_conversation("busy"), grpc.StatusCode.FAILED_PRECONDITION)
        assert said == "conversation 'busy' is already running a turn; abort it first"
        assert scheduler.pages.free_count == free_running and scheduler.conversations.get("default", "busy")
        assert await client.abort("busy-turn")
        last = None
        while (response := await call.read()) is not grpc.aio.EOF:
            last = response
        assert last is not None and last.finish_reason == client_pb2.FINISH_REASON_ABORT
        # Its answer is sent; its last step may not have committed: the delete waits for it.
        deleted = await client.delete_conversation("busy")
        assert deleted.snapshot_bytes == 0
        await stack.wait_idle()
    scheduler.pages.check()
    assert scheduler.pages.free_count == free_before and recorded(stack, "busy") == []


async def test_a_record_holding_no_tokens_is_deleted(deleting):
    """A restore that fell back (the cache evicted the snapshot) leaves the planner's record of the conversation
    holding nothing: the delete still drops it, where it answered NOT_FOUND and kept it (its turn's prompt and
    output ids too) for good."""
    stack = deleting.stack
    async with PlannerClient(stack.addr) as client:
        await turn(client, chat_of("glaciers"), "emptied")
        await stack.wait_idle()
        await client.park("emptied")
        async with CacheClient(f"127.0.0.1:{deleting.cached.servers[-1].port}") as cache:
            await cache.delete("default", "emptied")  # as the cache's eviction would
        await refused(client.resume("emptied"), grpc.StatusCode.NOT_FOUND)
        emptied = stack.scheduler.conversations.get("default", "emptied")
        assert emptied is not None and not emptied.tokens and not emptied.pages
        assert recorded(stack, "emptied") == ["conversations", "locks", "latest turns"]

        assert await client.delete_conversation("emptied") == Deleted(tokens=0, pages=0, snapshot_bytes=0)

        assert recorded(stack, "emptied") == []
        await refused(client.delete_conversation("emptied"), grpc.StatusCode.NOT_FOUND)


async def test_records_keeping_nothing_are_swept_once_the_planner_holds_many(deleting):
    """A conversation the cache's eviction emptied keeps its record (and its last turn's ids) until deleted; once
    the planner holds many records, opening another drops those keeping nothing (the first sweep waits for
    1,024, set lower here), and the next turn of that id starts fresh. Records holding pages stay."""
    stack = deleting.stack
    conversations = stack.scheduler.conversations
    async with PlannerClient(stack.addr) as client:
        await turn(client, chat_of("glaciers"), "swept")
        kept, _ = await turn(client, chat_of("rivers"), "kept")
        await stack.wait_idle()
        await client.park("swept")
        async with CacheClient(f"127.0.0.1:{deleting.cached.servers[-1].port}") as cache:
            await cache.delete("default", "swept")
        await refused(client.resume("swept"), grpc.StatusCode.NOT_FOUND)
        assert recorded(stack, "swept") == ["conversations", "locks", "latest turns"]
        conversations._sweep_at = len(conversations.every())  # the next record opened sweeps

        await turn(client, chat_of("lakes"), "opened")

        assert recorded(stack, "swept") == []
        assert (
            recorded(stack, "kept") == recorded(stack, "opened") == ["conversations", "locks", "latest turns"]
        )
        assert (
            not conversations.due_for_sweep()
        )  # the next waits for twice what this one left, at least 1,024
        answer = {"role": "assistant", "content": reply(stack, kept)}
        _, again = await turn(
            client, [*chat_of("rivers"), answer, {"role": "user", "content": "And another?"}], "kept"
        )
        assert again.checkpoint.startswith("checkpoint@")  # a record holding pages resumes
        _, fresh = await turn(client, chat_of("glaciers"), "swept")
        assert fresh.checkpoint in ("none", "prefix")  # no record: its pages, if any, from the prefix index
        await stack.wait_idle()
        for conversation_id in ("swept", "kept", "opened"):
            await client.delete_conversation(conversation_id)


async def test_a_draining_planner_refuses_a_delete_as_it_refuses_a_resume(deleting):
    stack = deleting.stack
    async with PlannerClient(stack.addr) as client:
        await turn(client, chat_of("dunes"), "drained")
        await stack.wait_idle()
        held = stack.scheduler.conversations.get("default", "drained")
        before = (list(held.tokens), list(held.pages), stack.scheduler.pages.free_count)
        stack.planner.draining = DRAINING  # what a drain sets first
        try:
            assert (
                await refused(client.delete_conversation("drained"), grpc.StatusCode.UNAVAILABLE) == DRAINING
            )
            assert await refused(client.resume("drained"), grpc.StatusCode.UNAVAILABLE) == DRAINING
        finally:
            stack.planner.draining = None
        assert (held.tokens, held.pages, stack.scheduler.pages.free_count) == before
        assert stack.scheduler.conversations.get("default", "drained") is held
        await client.delete_conversation("drained")


async def test_another_tenants_unknown_and_malformed_ids_are_refused_changing_nothing(deleting):
    stack = deleting.stack
    async with PlannerClient(stack.addr) as client:
        await turn(client, chat_of("lakes"), "theirs", tenant="alice")
        await stack.wait_idle()
        await client.park("theirs", tenant="alice")
        free = stack.scheduler.pages.free_count
        # Another tenant's is NOT_FOUND, said as for an id nobody has: its existence does not leak.
        said = await refused(client.delete_conversation("theirs", "bob"), grpc.StatusCode.NOT_FOUND)
        assert said == "no conversation 'theirs'"
        assert await refused(client.delete_conversation("nobody"), grpc.StatusCode.NOT_FOUND) == (
            "no conversation 'nobody'"
        )
        for conversation_id in ("", "x" * 100_000):
            said = await refused(
                client.delete_conversation(conversation_id), grpc.StatusCode.INVALID_ARGUMENT
            )
            assert "conversation_id" in said and len(said) < 100, "the id is not echoed whole"
        assert recorded(stack, "theirs", "bob") == recorded(stack, "nobody") == []
        assert stack.scheduler.pages.free_count == free
        assert [c.conversation_id for c in await client.conversations("alice")] == ["theirs"]
        assert deleting.snapshot_files("theirs", "alice")
        assert (await client.delete_conversation("theirs", "alice")).snapshot_bytes > 0
        assert await client.conversations("alice") == []


async def test_the_http_route_deletes_and_answers_as_openai_errors(deleting):
    stack = deleting.stack
    async with PlannerClient(stack.addr) as planner, httpx.AsyncClient(base_url=deleting.http_base) as http:
        await turn(planner, chat_of("hills"), "team/web-1")  # an id with a slash: the rest of the path
        await stack.wait_idle()
        held = stack.scheduler.conversations.get("default", "team/web-1")
        tokens, pages = len(held.tokens), len(held.pages)
        deleted = await http.delete("/v1/conversations/team/web-1")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {
            "id": "team/web-1",
            "object": "conversation.deleted",
            "deleted": True,
            "deltaserve": {"tokens": tokens, "pages": pages, "snapshot_bytes": 0},
        }
        assert recorded(stack, "team/web-1") == []
        again = await http.delete("/v1/conversations/team/web-1")
        error = again.json()["error"]
        assert (again.status_code, error["type"], error["code"]) == (404, "not_found_error", "not_found")
        assert error["message"] == "no conversation 'team/web-1'"
        too_long = await http.delete("/v1/conversations/" + "x" * 300)
        assert (too_long.status_code, too_long.json()["error"]["type"]) == (400, "invalid_request_error")
        # A turn streaming on it: 409, as over gRPC; the stream closed aborts it and the delete then goes.
        body = {
            "model": (await planner.model_info()).name,
            "messages": chat_of("hills"),
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
            "conversation_id": "web-2",
        }
        async with streaming_turn(http, body):
            busy = await http.delete("/v1/conversations/web-2")
        assert (busy.status_code, busy.json()["error"]["code"]) == (409, "failed_precondition")
        await stack.wait_idle(timeout=10)
        assert (await http.delete("/v1/conversations/web-2")).status_code == 200
    assert recorded(stack, "web-2") == []


async def test_the_snapshot_alone_after_a_restart_and_nothing_while_the_cache_is_down(tmp_path):
    """After a restart only the cache holds a parked conversation: delete removes its snapshot (and a resume
    then finds nothing). A cache that cannot be asked: UNAVAILABLE, and the conversation keeps everything."""
    cached = CachedStack(str(tmp_path))
    await cached.start()
    try:
        async with PlannerClient(cached.stack.addr) as client:
            await turn(client, chat_of("clouds"), "parked")
            await cached.stack.wait_idle()
            await client.park("parked")
        await cached.stop()
        stack = await cached.start()
        async with PlannerClient(stack.addr) as client:
            deleted = await client.delete_conversation("parked")
            assert deleted == Deleted(tokens=0, pages=0, snapshot_bytes=deleted.snapshot_bytes)
            assert deleted.snapshot_bytes > 0 and recorded(stack, "parked") == []
            await refused(client.resume("parked"), grpc.StatusCode.NOT_FOUND)

            await turn(client, chat_of("clouds"), "kept")
            await stack.wait_idle()
            kept = stack.scheduler.conversations.get("default", "kept")
            before = (list(kept.tokens), list(kept.pages), stack.scheduler.pages.free_count)
            await cached.servers[-1].stop(None)  # the cache goes away
            said = await refused(client.delete_conversation("kept"), grpc.StatusCode.UNAVAILABLE)
            assert said.startswith("deleting the snapshot failed: ")
            assert (kept.tokens, kept.pages, stack.scheduler.pages.free_count) == before
            assert stack.scheduler.conversations.get("default", "kept") is kept
    finally:
        await cached.stop()
