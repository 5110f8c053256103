"""A hybrid conversation's park and resume racing what else runs, over real gRPC with a cache service: state
pressure takes nothing from a conversation while its executor parks it, a resume while its turn runs is refused,
and a resume whose caller is gone gives back the pages and state slots it took once the executor answered."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from planner_svc.client import GenerateOptions, PlannerClient
from tests.conftest import stop_stack
from tests.hybrid_model import build_text_model, save_layouts, start_with_cache

pytestmark = pytest.mark.asyncio(loop_scope="session")

STATE_SLOTS = 4
PROMPT = [(7 * i) % 500 + 3 for i in range(21)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tmp_path_factory):
    from tests.hf_reference import hf_tokenizer

    root = tmp_path_factory.mktemp("park_races")
    model_dir, _ = save_layouts(build_text_model(), str(root / "model"), hf_tokenizer())
    stack, servers, cache = await start_with_cache(model_dir, str(root / "cache"), STATE_SLOTS)
    yield stack
    await stop_stack([*servers, cache])


async def _turn(stack, client: PlannerClient, name: str):
    await client.generate_all(GenerateOptions(token_ids=PROMPT, max_tokens=3, conversation_id=name))
    await stack.wait_idle()
    (conversation,) = [c for c in stack.scheduler.conversations.every() if c.conversation_id == name]
    return conversation


async def _all_free_but(stack, held_pages: int = 0, held_states: int = 0) -> None:
    """Until the pools hold all but what the conversations keep (a shielded RPC may still be answering)."""
    scheduler = stack.scheduler
    for _ in range(500):
        if (scheduler.pages.free_count, scheduler.states.free_count) == (
            scheduler.pages.total - held_pages,
            scheduler.states.total - held_states,
        ):
            break
        await asyncio.sleep(0.01)
    assert scheduler.pages.free_count == scheduler.pages.total - held_pages
    assert scheduler.states.free_count == scheduler.states.total - held_states
    scheduler.states.check()


async def test_state_pressure_skips_a_conversation_being_parked(stack):
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "parked")
        assert conversation.states and conversation.pages
        conversations = stack.scheduler.conversations
        park = asyncio.ensure_future(client.park("parked"))
        seen = False
        while not park.done():
            if conversation.parking:  # the executor reads its pages and states now: nothing takes them
                seen = True
                assert conversations.coldest_idle() is None and conversations.drop_state_copy() is None
                assert conversation.states and conversation.pages
            await asyncio.sleep(0)
        assert (await park).bytes > 0 and seen and not conversation.parking
        await _all_free_but(stack)
        await client.resume("parked")
        await stack.wait_idle()
        stack.scheduler.return_pages(conversation.forget())


async def test_resume_while_its_turn_runs_is_refused(stack):
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "running")
        assert (await client.park("running")).bytes > 0
        await client.resume("running")  # the cache keeps the snapshot
        history = list(conversation.tokens) + [5, 6]
        options = GenerateOptions(
            token_ids=history, max_tokens=40, ignore_eos=True, conversation_id="running"
        )
        stream = client.generate(options)
        await stream.__anext__()  # its turn runs
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.resume("running")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "running a turn" in (refused.value.details() or "")
        async for _ in stream:
            pass
        await stack.wait_idle()
        assert conversation.tokens[: len(history)] == history and len(conversation.states) == 2
        stack.scheduler.return_pages(conversation.forget())
        await _all_free_but(stack)


async def test_a_cancelled_resume_gives_its_pages_and_state_slots_back(stack):
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "gone")
        checkpoints = list(conversation.retention.positions)
        assert (await client.park("gone")).bytes > 0
        await _all_free_but(stack)
        resume = asyncio.ensure_future(stack.planner.turns.resume(conversation.tenant, "gone"))
        while stack.scheduler.states.free_count == stack.scheduler.states.total:  # until it took its slots
            await asyncio.sleep(0)
        resume.cancel()  # its client is gone while the executor copies the snapshot in
        with pytest.raises(asyncio.CancelledError):
            await resume
        assert conversation.parked and not conversation.pages and not conversation.states
        await _all_free_but(stack)
        assert (await client.resume("gone")).checkpoints == checkpoints  # still parked: it restores
        stack.scheduler.return_pages(conversation.forget())
        await _all_free_but(stack)
