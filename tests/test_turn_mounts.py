"""Turns waiting with their conversations' pages mounted, each needing pages the other holds, with nothing
running: one gives its mount back (Turns._unmount), or the engine would wait for ever. And what a turn's last
message reports of its pin when an executor was lost after the turn ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from planner_svc.config import SchedulingConfig
from planner_svc.conversations import Conversations
from planner_svc.planned import SchedulerConfig
from planner_svc.requests import Request, Sampling
from planner_svc.retention import RetentionConfig
from planner_svc.scheduler import Scheduler
from planner_svc.turns import Turns
from protos.layout import RowLayout

PAGE, POOL_PAGES = 4, 20  # 19 usable pages


def scheduler() -> Scheduler:
    config = SchedulerConfig(
        page_size=PAGE,
        pool_pages=POOL_PAGES,
        buckets=(1, 2),
        max_seq_len=64,
        vocab_size=100,
        settings=SchedulingConfig(prefill_token_budget=16),
    )
    layout = RowLayout.build([1, 2], 64, PAGE, POOL_PAGES)
    return Scheduler(config, layout, Conversations(PAGE, RetentionConfig()))


def test_a_waiting_turn_behind_the_head_gives_its_mount_back_when_nothing_else_can_free_pages():
    s = scheduler()
    woken: list[int] = []
    engine = SimpleNamespace(scheduler=s, conversations=s.conversations, wake=lambda: woken.append(1))
    turns = []
    for name, base in (("a", 10), ("b", 40)):
        conversation = s.conversations.open("t", name)
        history = list(range(base, base + 28))  # 7 pages kept
        s.conversations.finish_turn(conversation, history, s.pages.allocate(7), [28])
        request = Request(name, history + list(range(1, 21)), 4, Sampling())  # 13 pages in all
        s.add(request)
        Turns._mount(engine, conversation, request, None)  # type: ignore[arg-type]
        assert request.reused == 28 and len(request.pages) == 7
        turns.append(request)
    first, second = turns
    assert s.pages.free_count == 5 and s.blocked() and s.plan(0) is None  # each needs 6 more; neither runs

    async def relieved() -> None:
        Turns._unmount(engine)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the wake-up comes after the engine's loop went idle

    asyncio.run(relieved())
    assert woken and second.pages == [] and second.reused == second.prefilled == 0
    assert first.reused == 28 and second.conversation is not None and second.conversation.tokens == []
    step = s.plan(0)
    assert step is not None and [chunk.request for chunk in step.prefill] == [first]
    s.pages.check()


def test_a_pin_report_after_an_executor_lost_since_the_turn_says_the_kv_went_with_it():
    """The turn's end kept its pin; a loss before its last message was written forgot the conversation's KV."""
    from planner_svc.recovery import recover
    from planner_svc.responses import _pin_report

    s = scheduler()
    conversation = s.conversations.open("t", "doc")
    history = list(range(10, 38))
    s.conversations.finish_turn(conversation, history, s.pages.allocate(7), [16, 28], pinned=16)
    request = Request("doc", history, 4, Sampling(), pinned=16, pin_asked=True, released=True)
    request.conversation, request.pin_kept = conversation, 16

    async def report() -> tuple[int, str]:
        async def released(_: Request) -> None:
            return None

        return await _pin_report(SimpleNamespace(released=released), request)  # type: ignore[arg-type]

    assert asyncio.run(report()) == (16, "")
    recover(s, last_seq=-1, refused_seq=None, reason="executor 127.0.0.1:1 lost: gone")
    assert asyncio.run(report()) == (
        0,
        "the conversation's KV went with its executor after the turn: executor 127.0.0.1:1 lost: gone",
    )
