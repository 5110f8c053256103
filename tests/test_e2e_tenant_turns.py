"""Tenants over real gRPC, with room for one request at a time: a tenant whose request arrives behind another
tenant's queue runs after one of those, not after all of them; with --max-waiting-per-tenant a tenant at its
share of the queue is refused while another's request still queues."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from planner_svc.client import GenerateOptions, PlannerClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

_PROMPTS = itertools.count()


def _prompt() -> list[int]:
    """20 tokens (with 8 new ones, two pages of 16), each prompt its own: no prefix page is shared, so every
    request needs two free pages."""
    return [1000 + next(_PROMPTS)] + [504, 3575, 282, 4649, 314] * 3 + [504, 3575, 282, 4649]


async def _until_waiting(scheduler, count: int) -> None:
    async with asyncio.timeout(60):
        while len(scheduler.waiting) < count:
            await asyncio.sleep(0.005)


async def test_a_tenant_behind_anothers_queue_waits_one_turn(smol_stack):
    scheduler = smol_stack.scheduler
    await smol_stack.wait_idle()
    held = scheduler.pages.allocate(scheduler.pages.free_count - 2)  # room for one request at a time
    finished: list[str] = []
    try:
        async with PlannerClient(smol_stack.addr) as client:

            async def run(request_id: str, tenant: str) -> None:
                options = GenerateOptions(
                    token_ids=_prompt(), max_tokens=8, ignore_eos=True, request_id=request_id, tenant=tenant
                )
                await client.generate_all(options)
                finished.append(request_id)

            flood = [asyncio.create_task(run(f"a{i}", "alice")) for i in range(5)]
            await _until_waiting(scheduler, 4)  # one of alice's runs, her four others wait
            late = asyncio.create_task(run("b0", "bob"))
            await asyncio.wait_for(asyncio.gather(*flood, late), 120)
    finally:
        await smol_stack.wait_idle()
        scheduler.return_pages(held)
    # alice's first ran while the rest queued (in whatever order they arrived); bob's took the turn after her next
    assert finished[2] == "b0" and sorted(finished) == ["a0", "a1", "a2", "a3", "a4", "b0"]


async def test_a_tenant_at_its_share_of_the_queue_is_refused_while_another_queues(smol_stack, monkeypatch):
    scheduler = smol_stack.scheduler
    monkeypatch.setattr(smol_stack.planner, "max_waiting_per_tenant", 2)
    await smol_stack.wait_idle()
    held = scheduler.pages.allocate(scheduler.pages.free_count - 2)  # room for one request at a time
    try:
        async with PlannerClient(smol_stack.addr) as client:

            def run(request_id: str, tenant: str) -> asyncio.Task:
                options = GenerateOptions(
                    token_ids=_prompt(), max_tokens=8, ignore_eos=True, request_id=request_id, tenant=tenant
                )
                return asyncio.create_task(client.generate_all(options))

            running = [run(f"a{i}", "alice") for i in range(3)]  # one runs, two wait: alice's share
            await _until_waiting(scheduler, 2)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate_all(GenerateOptions(token_ids=_prompt(), max_tokens=8, tenant="alice"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.details() == (
                "tenant 'alice' has its share of the waiting queue: 2 choices wait for admission "
                "(--max-waiting-per-tenant 2); retry later"
            )
            bob = run("b0", "bob")  # another tenant's request still queues, and runs
            done = await asyncio.wait_for(asyncio.gather(*running, bob), 120)
            assert all(len(g.token_ids) == 8 for g in done)
    finally:
        await smol_stack.wait_idle()
        scheduler.return_pages(held)
