"""A conversation's turn racing what else acts on it, over real gRPC, each interleaving driven by the test through
the planner's link: a turn waiting on its conversation's lock while a failing Resume removes that conversation
finds it again and runs on the live one; a drain names a turn whose last step did not come back in time."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from planner_svc import drain as drains
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from protos import executor_pb2
from tests.conftest import start_stack, stop_stack
from tests.hybrid_model import build_text_model, save_layouts
from tests.test_e2e_loss_races import PROMPT, FaultyLink, _check_pools, _forget, _turn

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


def _executor(model_dir: str, cache: str | None = None) -> ExecutorConfig:
    return ExecutorConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        pool_pages=32,
        page_size=16,
        buckets=(1, 2),
        state_slots=6,
        cache=cache,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cached_stack(model_dir, tmp_path_factory):
    cache = await start_cache_server(str(tmp_path_factory.mktemp("turn_races_cache")), budget_bytes=1 << 30)
    address = f"127.0.0.1:{cache.port}"
    stack, servers = await start_stack(
        _executor(model_dir, address), PlannerConfig(model=model_dir, cache=address), link=HeldLink
    )
    yield stack
    await stop_stack([*servers, cache])


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


async def test_a_drain_names_a_turn_that_did_not_end_in_time(model_dir, monkeypatch):
    """A turn the drain cut owns its conversation until its last step commits; where that step's output does not
    come back within the settling time (held here), the drain says so, naming the conversation, in its report
    and its log line, and leaves it unparked, rather than skip it in silence."""
    monkeypatch.setattr(drains, "CUT_SETTLE_S", 0.3)  # the drain's 5 s, shorter: the output is held past it
    stack, servers = await start_stack(_executor(model_dir), PlannerConfig(model=model_dir), link=HeldLink)
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
