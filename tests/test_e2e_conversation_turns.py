"""Conversations over the real stack with the cache service, on one stack for the module: reuse across
turns and retries, an abort before a turn starts, park and restart, history rewrites, corrupted snapshots
and restores refused by the guard, shared prefixes, unknown or busy conversations, and tenants (issue 4)."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import pytest_asyncio
import torch

from cache_svc.manifest import snapshot_key
from executor_svc.copy_stream import CopyStream
from planner_svc.client import PlannerClient
from protos import client_pb2
from tests.cached_stack import PAGE, SYSTEM, CachedStack, reply, turn

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cached(tmp_path_factory):
    stack = CachedStack(str(tmp_path_factory.mktemp("cache")))
    await stack.start()
    yield stack
    await stack.stop()


async def test_second_turn_reuses_the_first(cached):
    stack = cached.stack
    chat = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    async with PlannerClient(stack.addr) as client:
        first, done = await turn(client, chat, "reuse")
        assert done.read_tokens == done.prompt_tokens - done.reused_tokens
        chat2 = chat + [
            {"role": "assistant", "content": reply(stack, first)},
            {"role": "user", "content": "Name another."},
        ]
        second, done2 = await turn(client, chat2, "reuse")
        fresh, _ = await turn(client, chat2)  # no conversation: a full read
    first_prompt = done.prompt_tokens
    assert done2.checkpoint == f"checkpoint@{first_prompt}"
    assert done2.reused_tokens == first_prompt // PAGE * PAGE > 0
    assert done2.read_tokens == done2.prompt_tokens - done2.reused_tokens
    assert second == fresh


async def test_a_retried_turn_reuses_every_whole_page_of_its_prompt(cached):
    """The same turn sent again (a client's retry): the checkpoint at its prompt's end is mounted and every
    whole page before the last prompt token reused (a checkpoint short of the end kept one page before), with
    the tokens of a fresh read."""
    stack = cached.stack
    chat = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
    async with PlannerClient(stack.addr) as client:
        first, _ = await turn(client, chat, "retry")
        chat2 = chat + [
            {"role": "assistant", "content": reply(stack, first)},
            {"role": "user", "content": "Name another."},
        ]
        await turn(client, chat2, "retry")
        again, done = await turn(client, chat2, "retry")
        fresh, _ = await turn(client, chat2)
    assert done.checkpoint == f"checkpoint@{done.prompt_tokens}", done.checkpoint
    assert done.reused_tokens == (done.prompt_tokens - 1) // PAGE * PAGE
    assert again == fresh


async def test_an_abort_while_a_turn_waits_to_start_ends_it(cached):
    """Abort of a request whose id is taken but that is not admitted yet (its turn waits for a park of its
    conversation to end, then restores): aborted=true, and the turn ends as aborted when it is admitted (it
    was answered false, and the turn then ran to its end)."""
    stack = cached.stack
    planner = stack.planner
    chat = [SYSTEM, {"role": "user", "content": "Count: " + " ".join(str(i) for i in range(400))}]
    async with PlannerClient(stack.addr) as client:
        first, _ = await turn(client, chat, "early-abort", max_tokens=2)
        chat2 = chat + [
            {"role": "assistant", "content": reply(stack, first)},
            {"role": "user", "content": "Go on."},
        ]
        parking = asyncio.ensure_future(client.park("early-abort"))
        await asyncio.sleep(0)  # the park takes the conversation's lock first
        started = asyncio.ensure_future(
            turn(client, chat2, "early-abort", max_tokens=200, request_id="early")
        )
        while not any(rid == "early" for _, rid in planner._request_ids):
            await asyncio.sleep(0.001)
        assert not any(rid == "early" for _, rid in planner.running_requests), "admitted too soon to test"
        assert await client.abort("early")
        tokens, last = await started
        await parking
    assert last.finish_reason == client_pb2.FINISH_REASON_ABORT and len(tokens) < 200
    await stack.wait_idle()


async def test_park_restart_resume_equals_never_parked(cached, tmp_path):
    stack = cached.stack
    chat = [SYSTEM, {"role": "user", "content": "What is the largest planet?"}]
    async with PlannerClient(stack.addr) as client:
        first, _ = await turn(client, chat, "parked")
        await stack.wait_idle()
        conversation = stack.scheduler.conversations.get("default", "parked")
        pool = stack.runner.kv_pool
        parked_pages = list(conversation.pages)
        parked_k = pool.k[:, parked_pages].clone()
        parked_v = pool.v[:, parked_pages].clone()
        parked = await client._stub.Park(client_pb2.ParkRequest(conversation_id="parked"))
        assert parked.bytes > 0 and parked.tokens == len(conversation.tokens)
        assert conversation.parked and not conversation.pages
    await cached.stop()  # every service restarts; only the cache directory remains
    stack = await cached.start()
    chat2 = chat + [
        {"role": "assistant", "content": reply(stack, first)},
        {"role": "user", "content": "And the smallest?"},
    ]
    async with PlannerClient(stack.addr) as client:
        resumed = await client._stub.Resume(client_pb2.ResumeRequest(conversation_id="parked"))
        conversation = stack.scheduler.conversations.get("default", "parked")
        restored = conversation.pages
        assert torch.equal(stack.runner.kv_pool.k[:, restored], parked_k)  # byte for byte
        assert torch.equal(stack.runner.kv_pool.v[:, restored], parked_v)
        assert resumed.tokens == len(conversation.tokens)
        second, done = await turn(client, chat2, "parked")
        never_parked, _ = await turn(client, chat2)
    assert done.checkpoint.startswith("snapshot@") or done.checkpoint.startswith("checkpoint@")
    assert done.reused_tokens > 0
    assert second == never_parked


async def test_rewritten_history_resumes_at_the_newest_checkpoint_before_the_change(cached):
    stack = cached.stack
    chat = [SYSTEM]
    async with PlannerClient(stack.addr) as client:
        for i in range(40):
            chat.append({"role": "user", "content": f"Turn {i}: say the number {i * 7}."})
            tokens, done = await turn(client, chat, "long", max_tokens=3)
            chat.append({"role": "assistant", "content": reply(stack, tokens)})
        listed = await client._stub.ListConversations(client_pb2.ListConversationsRequest())
        (long,) = [c for c in listed.conversations if c.conversation_id == "long"]
        edited = [dict(m) for m in chat]
        edited[-10]["content"] = "Turn 35 rewritten: say nothing."
        edited.append({"role": "user", "content": "Go on."})
        ids = stack.planner.tokenizer.apply_chat_template(edited, add_generation_prompt=True)["input_ids"]
        original = stack.planner.tokenizer.apply_chat_template(chat, add_generation_prompt=False)["input_ids"]
        changed = next(i for i, (a, b) in enumerate(zip(ids, original)) if a != b)
        expected = max(c for c in long.checkpoints if c <= changed)
        tokens, done = await turn(client, edited, "long", max_tokens=6)
        full, _ = await turn(client, edited, max_tokens=6)
    assert len(long.checkpoints) == 6
    assert done.checkpoint == f"checkpoint@{expected}"
    assert done.diverged_at == changed
    assert done.read_tokens == len(ids) - expected // PAGE * PAGE
    assert tokens == full


async def test_corrupted_snapshot_is_refused_and_the_prompt_read_again(cached):
    stack = cached.stack
    chat = [SYSTEM, {"role": "user", "content": "Spell the word cat."}]
    async with PlannerClient(stack.addr) as client:
        first, _ = await turn(client, chat, "corrupt")
        await client._stub.Park(client_pb2.ParkRequest(conversation_id="corrupt"))
        folder = os.path.join(cached.cache_dir, "snapshots", snapshot_key("default", "corrupt"))
        blob = sorted(f for f in os.listdir(folder) if f.endswith(".blob"))[0]
        with open(os.path.join(folder, blob), "r+b") as f:  # flip one byte of the first shard
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        chat2 = chat + [
            {"role": "assistant", "content": reply(stack, first)},
            {"role": "user", "content": "And dog?"},
        ]
        tokens, done = await turn(client, chat2, "corrupt")
        full, _ = await turn(client, chat2)
    assert "none (snapshot refused: DATA_LOSS" in done.checkpoint
    assert "@" not in done.checkpoint  # only pages shared by identical prompt tokens, no checkpoint
    assert done.read_tokens == done.prompt_tokens - done.reused_tokens
    assert tokens == full


async def test_a_restore_refused_by_the_guard_reads_the_prompt_again(cached):
    """A card with no copy stream yet and almost no free memory refuses the restore: the turn reads its
    prompt again, says why in its checkpoint, and the snapshot stays in the cache for a later restore."""
    stack = cached.stack
    snapshots = cached.servers[1].servicer.snapshots  # the executor's
    chat = [SYSTEM, {"role": "user", "content": "Count to three."}]
    async with PlannerClient(stack.addr) as client:
        first, _ = await turn(client, chat, "guarded")
        await client._stub.Park(client_pb2.ParkRequest(conversation_id="guarded"))
        own = snapshots.copy_stream
        snapshots.copy_stream = CopyStream(own.device, free_memory=lambda: 1 << 20)  # a fresh, full card
        try:
            chat2 = chat + [
                {"role": "assistant", "content": reply(stack, first)},
                {"role": "user", "content": "And to four?"},
            ]
            tokens, done = await turn(client, chat2, "guarded")
        finally:
            snapshots.copy_stream = own
        full, _ = await turn(client, chat2)
    assert (
        "none (snapshot refused: RESOURCE_EXHAUSTED: restore refused: cpu has 1 MiB free" in done.checkpoint
    )
    assert done.read_tokens == done.prompt_tokens - done.reused_tokens
    assert tokens == full
    assert os.path.isdir(os.path.join(cached.cache_dir, "snapshots", snapshot_key("default", "guarded")))


async def test_shared_prefix_is_pinned_and_malformed_ones_refused(cached):
    stack = cached.stack
    document = {"role": "system", "content": "A long shared document. " * 40}
    async with PlannerClient(stack.addr) as client:
        chat = [document, {"role": "user", "content": "Summarise it."}]
        answer, _ = await turn(client, chat)
        assert answer[3] not in answer[:3]
        # A stop token ends the turn a step before its pages go back (the planner had planned its row on):
        # the last message waits for that, to say what the conversation keeps.
        _, done = await turn(
            client,
            chat,
            "doc",
            shared_prefix=client_pb2.SharedPrefix(messages=1),
            stop_token_ids=[answer[3]],
        )
        assert done.finish_reason == client_pb2.FINISH_REASON_STOP
        await stack.wait_idle()
        conversation = stack.scheduler.conversations.get("default", "doc")
        pinned = conversation.retention.pinned
        assert pinned and pinned < done.prompt_tokens
        assert (done.pinned_prefix, done.pin_note) == (pinned, "")  # the answer says what is pinned
        for i in range(8):  # many short questions over one document keep the pin
            _, done = await turn(
                client, [document, {"role": "user", "content": f"Question {i}?"}], "doc", max_tokens=2
            )
            assert not done.HasField("pinned_prefix")  # asked for none
        assert conversation.retention.pinned == pinned
        # One that cannot be marked leaves the pin as it was, and the answer says why it is not the one asked
        _, done = await turn(client, chat, "doc", shared_prefix=client_pb2.SharedPrefix(tokens=100000))
        assert done.pinned_prefix == pinned == conversation.retention.pinned
        assert (
            done.pin_note
            == f"the shared prefix was not marked: the shared prefix covers the whole prompt ({done.prompt_tokens} tokens)"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await turn(client, chat, "doc", shared_prefix=client_pb2.SharedPrefix(messages=5))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shared_prefix.messages must be in [0, 2]" in caught.value.details()


async def test_unknown_conversation_and_busy_park(cached):
    async with PlannerClient(cached.stack.addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client._stub.Park(client_pb2.ParkRequest(conversation_id="nobody"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client._stub.Resume(client_pb2.ResumeRequest(conversation_id="nobody"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        # A turn refused before its mount (it could never fit the pool) keeps no record of the id either.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await turn(client, [SYSTEM], "nobody", max_tokens=7000, ignore_eos=True)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        turns = cached.stack.planner.turns
        assert not any(key[1] == "nobody" for key in [*turns._locks, *turns._latest]), "no trace left"
        assert cached.stack.scheduler.conversations.get("default", "nobody") is None
        # Nothing named, or a name too long: refused as such (an empty id once resumed another's snapshot).
        for call in (
            client._stub.Park(client_pb2.ParkRequest(conversation_id="")),
            client._stub.Resume(client_pb2.ResumeRequest(conversation_id="")),
            client._stub.Resume(client_pb2.ResumeRequest(conversation_id="x" * 100_000)),
            client._stub.Abort(client_pb2.AbortRequest(request_id="")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert len(caught.value.details()) < 100, "the id is not echoed whole"


async def test_tenants_do_not_see_each_other(cached):
    stack = cached.stack
    chat = [SYSTEM, {"role": "user", "content": "Hello."}]
    async with PlannerClient(stack.addr) as client:
        await turn(client, chat, "mine", tenant="alice")
        await client._stub.Park(client_pb2.ParkRequest(conversation_id="mine", tenant="alice"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client._stub.Park(client_pb2.ParkRequest(conversation_id="mine", tenant="bob"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        listed = await client._stub.ListConversations(client_pb2.ListConversationsRequest(tenant="bob"))
        assert not [c for c in listed.conversations if c.conversation_id == "mine"]
        _, done = await turn(client, chat, "mine", tenant="bob")  # bob's own, new conversation
        assert not done.checkpoint.startswith("snapshot")
