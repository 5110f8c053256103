"""A conversation's turn racing what else acts on it, over real gRPC, each interleaving driven by the test through
the planner's link: a turn waiting on its conversation's lock while a failing Resume removes that conversation
finds it again and runs on the live one; a turn refused because its executor was lost while it mounted leaves
its conversation as it found it, free for the next turn; a drain names a turn whose last step did not come back
in time."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from cache_svc.server import start_cache_server
from planner_svc import drain as drains
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from protos import executor_pb2
from tests.conftest import start_stack, stop_stack
from tests.hybrid_model import build_text_model, save_layouts
from tests.test_e2e_loss_races import PROMPT, FaultyLink, _check_pools, _forget, _turn, executor_config

pytestmark = pytest.mark.asyncio(loop_scope="session")


class HeldLink(FaultyLink):
    """FaultyLink (a restore held until the test answers it), whose step outputs also wait while `outputs` is
    clear: the steps run, their commits wait."""

    def __init__(self, address: str):
        super().__init__(address)
        self.outputs = asyncio.Event()
        self.outputs.set()

    async def recv(self) -> executor_pb2.StepOutput:
        output = await super().recv()
        await self.outputs.wait()
        return output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.hf_reference import hf_tokenizer

    directory = tmp_path_factory.mktemp("turn_races")
    return save_layouts(build_text_model(), str(directory / "model"), hf_tokenizer())[0]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cached_stack(model_dir, tmp_path_factory):
    cache = await start_cache_server(str(tmp_path_factory.mktemp("turn_races_cache")), budget_bytes=1 << 30)
    address = f"127.0.0.1:{cache.port}"
    stack, servers = await start_stack(
        executor_config(model_dir, address), PlannerConfig(model=model_dir, cache=address), link=HeldLink
    )
    yield stack
    await stop_stack([*servers, cache])


@pytest_asyncio.fixture(loop_scope="session")
async def reaching_stack(cached_stack):
    """cached_stack, whose engine reaches its executor again after the test (one failing may leave it lost)."""
    yield cached_stack
    if not cached_stack.engine.link.back.is_set():
        await _back(cached_stack)


async def test_a_turn_waiting_on_a_failing_resume_runs_on_the_conversation_found_again(cached_stack):
    """Resume opens a conversation the planner does not know (its snapshot in the cache, as after a planner
    restart) and restores it while a turn of it waits on its lock. The restore fails: the resume removes what
    it opened. The turn finds the conversation again (Turns._locked): it opens a new one, restores the snapshot
    into it and runs there, so the registered conversation holds the turn's pages and nothing else holds any
    (on the removed object, they would be nobody's)."""
    stack, link = cached_stack, cached_stack.engine.link
    conversations = stack.scheduler.conversations
    async with PlannerClient(stack.addr) as client:
        first = await _turn(stack, client, "race")
        kept = list(first.tokens)
        assert (await client.park("race")).bytes > 0
        _forget(stack, first)  # the planner forgets it, as a restart would; the cache keeps its snapshot
        link.hold = asyncio.get_running_loop().create_future()
        link.holding.clear()
        resume = asyncio.ensure_future(client.resume("race"))
        await link.holding.wait()
        (opened,) = [c for c in conversations.every() if c.conversation_id == "race"]
        history = kept + [5, 6, 7]
        turn = asyncio.ensure_future(
            client.generate_all(GenerateOptions(token_ids=history, max_tokens=3, conversation_id="race"))
        )
        lock = stack.planner.turns.lock(opened)
        while not lock._waiters:  # asyncio's own queue of waiters: the turn waits for the resume's lock
            await asyncio.sleep(0.01)
        link.hold.set_result("failed")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await resume
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        got = await turn
    await stack.wait_idle()
    (live,) = [c for c in conversations.every() if c.conversation_id == "race"]
    assert live is not opened and got.checkpoint == f"snapshot@{len(kept)}"
    assert live.tokens == history + got.token_ids[:-1]
    _check_pools(stack, live.pages, list(live.states.values()))
    _forget(stack, live)


async def _lose_until_back(stack) -> None:
    """The executor's step stream ends, and the engine, recovered, cannot reach it again until `link.back` is set."""
    stack.engine.link.back.clear()
    stack.engine.link.end_stream()
    while stack.engine.serving:
        await asyncio.sleep(0.01)


async def _refused_unavailable(turn) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await turn
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "was lost" in (refused.value.details() or "")


async def _back(stack) -> None:
    stack.engine.link.back.set()
    await stack.engine.link.reopened()


async def test_a_turn_whose_executor_is_lost_while_it_restores_leaves_its_conversation_free(reaching_stack):
    """The executor is lost while a turn's mount awaits the restore of its parked conversation, and is not back
    when the restore answers (stale: it falls back). The turn is refused UNAVAILABLE and leaves the conversation
    as the loss did: holding nothing, running no turn. Once the executor is back, its next turn restores the
    snapshot and runs; once it is deleted, every page and state slot is free."""
    stack, link = reaching_stack, reaching_stack.engine.link
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "lost-restoring")
        kept = list(conversation.tokens)
        assert (await client.park("lost-restoring")).bytes > 0
        link.hold = asyncio.get_running_loop().create_future()
        link.holding.clear()
        history = kept + [5, 6, 7]
        options = GenerateOptions(token_ids=history, max_tokens=3, conversation_id="lost-restoring")
        turn = asyncio.ensure_future(client.generate_all(options))
        await link.holding.wait()  # the mount awaits the restore
        await _lose_until_back(stack)
        link.hold.set_result("answered")
        await _refused_unavailable(turn)
        assert not conversation.busy and not conversation.tokens and not conversation.pages
        assert not conversation.states
        _check_pools(stack, [], [])
        await _back(stack)
        got = await client.generate_all(options)
        assert got.checkpoint == f"snapshot@{len(kept)}"
        await stack.wait_idle()
        assert conversation.tokens == history + got.token_ids[:-1]
        _check_pools(stack, conversation.pages, list(conversation.states.values()))
        await client.delete_conversation("lost-restoring")
    _check_pools(stack, [], [])


async def test_a_turn_refused_while_its_executor_is_lost_keeps_what_its_restore_brought(reaching_stack):
    """A turn of a parked conversation starts while its executor is lost (the planner not yet reconnected, the
    executor already answering): its mount restores the conversation, then the turn is refused UNAVAILABLE.
    Though its prompt diverged from the conversation's tokens, the conversation keeps exactly what the restore
    brought (its tokens, pages and checkpoints with their state copies) and runs no turn; once the executor is
    back, its next turn mounts its newest checkpoint."""
    stack = reaching_stack
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "lost-restored")
        kept, checkpoints = list(conversation.tokens), conversation.retention.positions
        assert (await client.park("lost-restored")).bytes > 0
        await _lose_until_back(stack)
        diverged = kept[:10] + [9, 9, 9]
        options = GenerateOptions(token_ids=diverged, max_tokens=3, conversation_id="lost-restored")
        await _refused_unavailable(client.generate_all(options))
        assert not conversation.busy and not conversation.parked
        assert conversation.tokens == kept and conversation.retention.positions == checkpoints
        assert len(conversation.pages) == -(-len(kept) // stack.scheduler.config.page_size)
        assert sorted(conversation.states) == checkpoints
        _check_pools(stack, conversation.pages, list(conversation.states.values()))
        await _back(stack)
        history = kept + [5, 6, 7]
        got = await client.generate_all(
            GenerateOptions(token_ids=history, max_tokens=3, conversation_id="lost-restored")
        )
        assert got.checkpoint == f"checkpoint@{len(kept)}"
        await stack.wait_idle()
        assert conversation.tokens == history + got.token_ids[:-1]
        _check_pools(stack, conversation.pages, list(conversation.states.values()))
        assert (await client.park("lost-restored")).bytes > 0
        _check_pools(stack, [], [])
        await client.delete_conversation("lost-restored")


async def test_a_turn_refused_while_its_executor_is_lost_leaves_what_the_loss_left(reaching_stack):
    """A conversation whose KV went with the lost executor: a turn refused while the executor is not back leaves
    it as the recovery did (holding nothing, the loss noted), so that its next turn runs once the executor is
    back and says why it read its whole prompt."""
    stack = reaching_stack
    async with PlannerClient(stack.addr) as client:
        conversation = await _turn(stack, client, "lost-resident")
        history = conversation.tokens + [5, 6, 7]
        options = GenerateOptions(token_ids=history, max_tokens=3, conversation_id="lost-resident")
        await _lose_until_back(stack)
        lost = conversation.lost
        assert lost and not conversation.tokens and not conversation.pages and not conversation.states
        await _refused_unavailable(client.generate_all(options))
        assert not conversation.busy and conversation.lost == lost and not conversation.pages
        _check_pools(stack, [], [])
        await _back(stack)
        got = await client.generate_all(options)
        assert got.checkpoint == f"none ({lost})" and got.reused_tokens == 0
        await stack.wait_idle()
        _check_pools(stack, conversation.pages, list(conversation.states.values()))
        await client.delete_conversation("lost-resident")
    _check_pools(stack, [], [])


async def test_a_drain_names_a_turn_that_did_not_end_in_time(model_dir, monkeypatch):
    """A turn the drain cut owns its conversation until its last step commits; where that step's output does not
    come back within the settling time (held here), the drain says so, naming the conversation, in its report
    and its log line, and leaves it unparked, rather than skip it in silence."""
    monkeypatch.setattr(drains, "CUT_SETTLE_S", 0.3)  # the drain's 5 s, shorter: the output is held past it
    stack, servers = await start_stack(
        executor_config(model_dir), PlannerConfig(model=model_dir), link=HeldLink
    )
    link = stack.engine.link
    try:
        async with PlannerClient(stack.addr) as client:
            stream = client.generate(
                GenerateOptions(token_ids=PROMPT, max_tokens=200, conversation_id="slow", request_id="slow-1")
            )
            await stream.__anext__()  # it decodes
            link.outputs.clear()
            with capture_logs() as logs:
                report = await drains.drain(servers[0], timeout_s=0.1)
            link.outputs.set()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stream:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "cut" in caught.value.details()
        said = "default/slow: its turn did not end within 0.3 s"
        assert report.cut == 1 and report.not_parked == [said] and report.parked == []
        (drained,) = [entry for entry in logs if entry["event"] == "drained"]
        assert drained["not_parked"] == [said]
        await stack.wait_idle()
    finally:
        await stop_stack(servers)
