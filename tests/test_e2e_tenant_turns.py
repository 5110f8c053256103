"""Tenants take turns for admission, over real gRPC: with room for one request at a time, a tenant whose request
arrives behind another tenant's queue runs after one of those, not after all of them."""

from __future__ import annotations

import asyncio

import pytest

from planner_svc.client import GenerateOptions, PlannerClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [504, 3575, 282, 4649, 314] * 4  # 20 tokens: with 8 new ones, two pages of 16


async def test_a_tenant_behind_anothers_queue_waits_one_turn(smol_stack):
    scheduler = smol_stack.scheduler
    await smol_stack.wait_idle()
    held = scheduler.pages.allocate(scheduler.pages.free_count - 2)  # room for one request at a time
    finished: list[str] = []
    try:
        async with PlannerClient(smol_stack.addr) as client:

            async def run(request_id: str, tenant: str) -> None:
                options = GenerateOptions(
                    token_ids=PROMPT, max_tokens=8, ignore_eos=True, request_id=request_id, tenant=tenant
                )
                await client.generate_all(options)
                finished.append(request_id)

            flood = [asyncio.create_task(run(f"a{i}", "alice")) for i in range(5)]
            while len(scheduler.waiting) < 4:  # one of alice's runs, her four others wait
                await asyncio.sleep(0.005)
            late = asyncio.create_task(run("b0", "bob"))
            await asyncio.wait_for(asyncio.gather(*flood, late), 120)
    finally:
        await smol_stack.wait_idle()
        scheduler.return_pages(held)
    # alice's first ran while the rest queued (in whatever order they arrived); bob's took the turn after her next
    assert finished[2] == "b0" and sorted(finished) == ["a0", "a1", "a2", "a3", "a4", "b0"]
