"""A queue head starved of a recurrent-state slot, with the engine's own step loop running and only the executor
link faked (its steps recorded, never answered; a park or a restore answered when the test says): what
StatePressure.stuck counts on to free a slot wakes the engine when it ends (a park failing, a restore going
through), relief parks the next coldest holder where one's park fails, and a turn bringing its own slot counts
only where admission scans (beyond, relief neither waits for it nor drops a pinned conversation's pages)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from planner_svc.admission import SCAN_LIMIT
from planner_svc.conversations import Conversations
from planner_svc.engine import Engine
from planner_svc.link import LinkError
from planner_svc.parking import ConversationError
from planner_svc.requests import Phase, Request
from planner_svc.retention import RetentionConfig
from planner_svc.streaming import TokenEvent
from planner_svc.turns import Turns
from protos import cache_pb2, executor_pb2
from protos.wire import pack_i32, unpack_i32
from tests.state_scheduler import state_scheduler

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKENS = list(range(3, 27))
CACHE = "127.0.0.1:1"  # a cache is configured (relief parks); the fake link alone is asked


class FakeLink:
    """The executor: steps recorded and never answered; parks answered by `park_answer` (None: held until the
    test sets `release`), restores held until `release`, then answered with TOKENS and one checkpoint."""

    address = "fake"

    def __init__(self, park_answer: Callable[[str], Exception | None] | None = None) -> None:
        self.sent: list[executor_pb2.StepPlan] = []
        self.parks: list[str] = []  # the conversations whose park was asked, in order
        self.release = asyncio.Event()
        self.held = asyncio.Event()  # a park or a restore waits for `release`
        self.park_answer = park_answer

    async def open(self) -> None:
        pass

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        self.sent.append(plan)

    async def recv(self) -> executor_pb2.StepOutput:
        await asyncio.Event().wait()  # never answers (the engine's watchdog is set far off)
        raise AssertionError("unreachable")

    async def until_ended(self) -> str:
        await asyncio.Event().wait()
        return ""

    async def close(self) -> None:
        pass

    async def _hold(self) -> None:
        self.held.set()
        await self.release.wait()

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        self.parks.append(request.conversation_id)
        if self.park_answer is None:
            await self._hold()
            raise LinkError("the cache refused the snapshot")
        error = self.park_answer(request.conversation_id)
        if error is not None:
            raise error
        return executor_pb2.ParkPagesReply(bytes=1)

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        await self._hold()
        checkpoints = [cache_pb2.Checkpoint(position=len(TOKENS))]
        return executor_pb2.RestorePagesReply(token_ids=pack_i32(TOKENS), checkpoints=checkpoints)

    def prefilled(self) -> set[int]:
        """The first prompt token of each chunk sent (the requests planned)."""
        return {int(unpack_i32(chunk.token_ids)[0]) for plan in self.sent for chunk in plan.prefill}


async def _engine(link: FakeLink, state_slots: int, pinned: tuple[str, ...], cache: str | None = CACHE):
    """An engine over `link` with its loop running, and `pinned` idle conversations holding only their pins'
    copies (at 10) and their pages."""
    conversations = Conversations(4, RetentionConfig())
    scheduler = state_scheduler(state_slots=state_slots, conversations=conversations)
    chats = []
    for name in pinned:
        chat = conversations.open("tenant", name)
        conversations.mount(chat, TOKENS)
        pages = scheduler.take_pages(6)
        conversations.finish_turn(
            chat, TOKENS, pages, [], pinned=10, marked_states={10: scheduler.states.take()}
        )
        chats.append(chat)
    engine = Engine(scheduler, link, executor_pb2.ExecutorDescription(), executor_timeout=600.0)
    turns = Turns([engine], cache)
    await engine.start()
    return engine, turns, chats


async def _stop(engine: Engine, turns: Turns) -> None:
    await engine.stop()
    await turns.parking.close()


async def _until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def _refusals(queue: asyncio.Queue[TokenEvent]) -> list[str | None]:
    return [queue.get_nowait().code for _ in range(queue.qsize())]


async def test_a_failed_park_wakes_the_engine_for_the_head_it_made_wait():
    """Two state slots, each a pin's copy. A client parks `a`; a new request waits for it (stuck: None while a
    park is under way). The park fails: the engine plans again, relief parks `a` after all (the cache takes
    it now) and the request runs. It used to wait until unrelated traffic woke the engine."""
    link = FakeLink()
    engine, turns, (a, b) = await _engine(link, state_slots=3, pinned=("a", "b"))
    try:
        park = asyncio.ensure_future(turns.park("tenant", "a"))
        await asyncio.wait_for(link.held.wait(), 5)
        queue = engine.submit(Request("new", [1, 2, 3], max_tokens=2))
        await asyncio.sleep(0.1)  # planned, blocked, relief waits for the park: the engine idles
        assert not link.sent and engine.scheduler.pressure.stuck(engine.scheduler.waiting, True) is None
        link.park_answer = lambda _: None  # parks go through from now on
        link.release.set()
        with pytest.raises(ConversationError, match="refused the snapshot"):
            await park
        await _until(lambda: 1 in link.prefilled(), "the head was never planned after the park failed")
        assert link.parks == ["a", "a"] and a.parked and b.retention.pinned == 10 and queue.empty()
    finally:
        await _stop(engine, turns)


async def test_a_restore_going_through_wakes_the_engine_for_the_head_it_made_wait():
    """Three state slots: two pins' copies, the third lent to a client's restore of `c`. A new request waits for
    it (stuck: None while a loan holds slots). The restore goes through, its copy unpinned: the engine plans
    again and pressure takes that copy for the request. It used to wait for unrelated traffic."""
    link = FakeLink()
    engine, turns, _ = await _engine(link, state_slots=4, pinned=("a", "b"), cache=None)
    parked = engine.conversations.open("tenant", "c")
    parked.tokens, parked.parked = TOKENS, True
    parked.retention.add(len(TOKENS))
    try:
        resume = asyncio.ensure_future(turns.resume("tenant", "c"))
        await asyncio.wait_for(link.held.wait(), 5)
        assert engine.scheduler.states.free_count == 0
        engine.submit(Request("new", [1, 2, 3], max_tokens=2))
        await asyncio.sleep(0.1)
        assert not link.sent
        link.release.set()
        assert await resume is parked
        await _until(lambda: 1 in link.prefilled(), "the head was never planned after the restore")
    finally:
        await _stop(engine, turns)


async def test_relief_parks_the_next_coldest_holder_where_the_coldests_park_fails():
    """`a`, the coldest, cannot be parked (its snapshot over the cache's budget): `b` is, and the request runs.
    Every request used to be refused while `a` stayed the coldest."""
    from structlog.testing import capture_logs

    link = FakeLink(lambda name: LinkError("cache: snapshot over budget") if name == "a" else None)
    engine, turns, (a, b) = await _engine(link, state_slots=3, pinned=("a", "b"))
    try:
        with capture_logs() as logs:
            queue = engine.submit(Request("new", [1, 2, 3], max_tokens=2))
            await _until(lambda: 1 in link.prefilled() or not queue.empty(), "neither planned nor refused")
        assert queue.empty(), queue.get_nowait().error  # not refused
        assert link.parks == ["a", "b"] and b.parked and not a.parked and a.retention.pinned == 10
        failed = [e for e in logs if e["event"].startswith("could not park a conversation")]
        assert [(e["conversation"], "over budget" in e["error"]) for e in failed] == [("a", True)]
    finally:
        await _stop(engine, turns)


async def test_a_turn_bringing_its_slot_beyond_admissions_scan_does_not_send_relief_down_the_kv_path():
    """No cache; three state slots: two pins' copies and `c`'s unpinned copy, which `c`'s waiting turn is
    mounted on (it brings its slot). With SCAN_LIMIT + 6 requests ahead of it, admission never reaches it:
    relief used to count it all the same and take the KV path, dropping pinned `a` whole. Now the heads are
    refused, one at a time, until the turn comes into the scan and passes them; every pin holds."""
    link = FakeLink(lambda _: LinkError("no cache"))
    engine, turns, (a, b) = await _engine(link, state_slots=4, pinned=("a", "b"), cache=None)
    scheduler, conversations = engine.scheduler, engine.conversations
    c = conversations.open("tenant", "c")
    conversations.mount(c, [5, 6, 7, 8, 9])
    conversations.finish_turn(
        c, [5, 6, 7, 8, 9], scheduler.take_pages(2), [], state_slot=scheduler.states.take()
    )
    assert scheduler.states.free_count == 0
    ahead = SCAN_LIMIT + 6
    try:
        queues = [engine.submit(Request(f"new{i}", [1, 2, 3], max_tokens=2)) for i in range(ahead)]
        turn = Request("turn", [5, 6, 7, 8, 9, 10, 11], max_tokens=2)
        mount, release = conversations.mount(c, turn.prompt_ids)
        scheduler.return_pages(release)
        turn.pages, turn.reused, turn.prefilled = mount.pages, mount.reused, mount.reused
        turn.conversation, turn.state_source = c, mount.state_slot
        assert turn.brings_state
        engine.submit(turn)

        def passed() -> bool:
            return turn.phase is not Phase.WAITING

        await _until(lambda: passed() or not (a.pages and b.pages), "the turn never passed the head")
        for chat in (a, b):
            assert chat.retention.pinned == 10 and chat.pages and list(chat.states) == [10]
        assert passed() and not link.parks
        refused = [_refusals(queue) for queue in queues]
        assert refused == [["RESOURCE_EXHAUSTED"]] * 7 + [[]] * (ahead - 7)  # then it was within the scan
    finally:
        await _stop(engine, turns)
