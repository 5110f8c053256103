"""Tenants over real gRPC. The requests queue with no room for any; then room for one at a time opens, and the
order they are admitted in is recorded. A tenant whose request arrives behind another tenant's queue runs after one
of those, not after all of them; a request's later choices keep its place; with --max-waiting-per-tenant a tenant
at its share of the queue is refused while another's request still queues."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from planner_svc.client import GenerateOptions, PlannerClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

_PROMPTS = itertools.count()


def _prompt() -> list[int]:
    """20 tokens (with 8 new ones, two pages of 16), each prompt its own: no prefix page is shared, so every
    request needs two free pages."""
    return [1000 + next(_PROMPTS)] + [504, 3575, 282, 4649, 314] * 3 + [504, 3575, 282, 4649]


@asynccontextmanager
async def _queue_then_one_at_a_time(stack, monkeypatch) -> AsyncIterator[tuple[asyncio.Event, list[str]]]:
    """Every free page held until the event is set, then all but one request's two (relief off: earlier tests'
    idle conversations' pages would let requests run before the test opens room, or two at a time)."""
    admitted: list[str] = []
    record = stack.scheduler.order.admitted

    def recorded(request) -> None:
        admitted.append(request.request_id)
        record(request)

    monkeypatch.setattr(stack.scheduler.order, "admitted", recorded)
    async with stack.free_pages_held(monkeypatch) as held:
        opened = asyncio.Event()

        async def open_room() -> None:
            await opened.wait()
            stack.give_back(held, 2)

        opener = asyncio.create_task(open_room())
        try:
            yield opened, admitted
        finally:
            opened.set()
            await opener


async def _until_waiting(scheduler, count: int) -> None:
    async with asyncio.timeout(60):
        while len(scheduler.waiting) != count:
            await asyncio.sleep(0.005)


def _run(client: PlannerClient, request_id: str, tenant: str, n: int = 1) -> asyncio.Task:
    async def run() -> list[int]:
        options = GenerateOptions(
            token_ids=_prompt(), max_tokens=8, ignore_eos=True, request_id=request_id, tenant=tenant, n=n
        )
        return [len(choice.token_ids) for choice in await client.generate_choices(options)]

    return asyncio.create_task(run())


async def test_a_tenant_behind_anothers_queue_waits_one_turn(smol_stack, monkeypatch):
    async with (
        PlannerClient(smol_stack.addr) as client,
        _queue_then_one_at_a_time(smol_stack, monkeypatch) as (opened, admitted),
    ):
        flood = [_run(client, f"a{i}", "alice") for i in range(5)]
        await _until_waiting(smol_stack.scheduler, 5)
        late = _run(client, "b0", "bob")
        await _until_waiting(smol_stack.scheduler, 6)
        opened.set()
        await asyncio.wait_for(asyncio.gather(*flood, late), 120)
    # alice's first (in whatever order hers arrived), then bob's, then the rest of hers
    assert admitted[1] == "b0" and sorted(admitted) == ["a0", "a1", "a2", "a3", "a4", "b0"]


async def test_a_tenant_at_its_share_of_the_queue_is_refused_while_another_queues(smol_stack, monkeypatch):
    monkeypatch.setattr(smol_stack.planner, "max_waiting_per_tenant", 2)
    async with (
        PlannerClient(smol_stack.addr) as client,
        _queue_then_one_at_a_time(smol_stack, monkeypatch) as (opened, _),
    ):
        queued = [_run(client, f"a{i}", "alice") for i in range(2)]  # alice's share
        await _until_waiting(smol_stack.scheduler, 2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate_all(GenerateOptions(token_ids=_prompt(), max_tokens=8, tenant="alice"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            "tenant 'alice' has its share of the waiting queue: 2 choices wait for admission "
            "(--max-waiting-per-tenant 2); retry later"
        )
        bob = _run(client, "b0", "bob")  # another tenant's request still queues, and runs
        await _until_waiting(smol_stack.scheduler, 3)
        opened.set()
        assert await asyncio.wait_for(asyncio.gather(*queued, bob), 120) == [[8], [8], [8]]


async def test_a_later_choice_takes_its_firsts_place_as_it_is_when_queued(smol_stack, monkeypatch):
    """alice's a1 (two choices) is tagged behind her a0, and bob's b1 with it; a0 aborted, a1 moves up to the
    clock. Its second choice, queued once a1's first has read the prompt, goes where a1 is now: before b1."""
    async with (
        PlannerClient(smol_stack.addr) as client,
        _queue_then_one_at_a_time(smol_stack, monkeypatch) as (opened, admitted),
    ):
        queued = []
        for count, (request_id, tenant, n) in enumerate(
            [("a0", "alice", 1), ("b0", "bob", 1), ("a1", "alice", 2), ("b1", "bob", 1)], start=1
        ):
            queued.append(_run(client, request_id, tenant, n))
            await _until_waiting(smol_stack.scheduler, count)  # each tagged in this order
        aborted = queued.pop(0)
        aborted.cancel()
        await _until_waiting(smol_stack.scheduler, 3)
        opened.set()
        assert await asyncio.wait_for(asyncio.gather(*queued), 120) == [[8], [8, 8], [8]]
    assert admitted == ["b0", "a1", "a1", "b1"]
