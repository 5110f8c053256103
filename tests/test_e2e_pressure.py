"""Under KV pressure (a pool too small for every request at once) all requests still finish correctly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from tests.conftest import PARITY_TOKENS, SMOL_BUCKETS, start_stack, stop_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

POOL_PAGES = 161  # 160 usable pages of 16 tokens: one long prompt, or the short ones, at a time


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_pool_stack():
    stack, servers = await start_stack(
        ExecutorConfig(
            device="cpu", dtype="float32", pool_pages=POOL_PAGES, buckets=SMOL_BUCKETS, row_check=True
        ),
        PlannerConfig(scheduling=SchedulingConfig(row_check=True, prefill_token_budget=512)),
    )
    yield stack
    await stop_stack(servers)


async def test_kv_pressure_every_request_completes_with_the_right_tokens(small_pool_stack, hf_answers):
    scheduler = small_pool_stack.scheduler
    most_waiting = 0

    async def watch():
        nonlocal most_waiting
        while True:
            most_waiting = max(most_waiting, len(scheduler.waiting))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    async with PlannerClient(small_pool_stack.addr) as client:
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(chat=chat, max_tokens=PARITY_TOKENS))
                for chat, _ in hf_answers
            )
        )
    watcher.cancel()
    for got, (_, expected) in zip(results, hf_answers):
        assert got.token_ids == expected
    assert most_waiting > 0, "the pool was never short: the test does not test pressure"
    assert small_pool_stack.engine.row_mismatches == 0
    await small_pool_stack.wait_idle()
    assert scheduler.pages.free_count == scheduler.pages.total


async def test_request_larger_than_the_pool_is_refused_at_once(small_pool_stack):
    async with PlannerClient(small_pool_stack.addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.generate_all(GenerateOptions(token_ids=[5] * 3000, max_tokens=100))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == "the request needs 194 KV pages and the pool has 160"
    assert small_pool_stack.scheduler.idle


async def test_turns_waiting_on_each_others_mounts_give_them_up_rather_than_wait_for_ever():
    """Two conversations keep 15 pages each; their next turns mount them and each needs 13 more, with 10
    free and nothing running to free any. Neither fits while the other holds its mount: the one behind the
    head gives its pages back and reads its whole prompt."""
    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", dtype="float32", pool_pages=41, buckets=(1, 2, 4)),
        PlannerConfig(scheduling=SchedulingConfig(prefill_token_budget=256)),
    )
    try:
        async with PlannerClient(stack.addr) as client:

            async def turn(prompt: list[int], conversation: str = ""):
                options = GenerateOptions(token_ids=prompt, max_tokens=2, ignore_eos=True)
                if conversation:
                    options.conversation_id = conversation
                return await asyncio.wait_for(client.generate_all(options), 60)

            histories = {}
            for name, base in (("c1", 100), ("c2", 300)):
                prompt = [base + i % 50 for i in range(240)]
                histories[name] = prompt + (await turn(prompt, name)).token_ids
            nexts = {name: history + [7 + i % 40 for i in range(190)] for name, history in histories.items()}
            # Whether both mount before either is planned is up to timing (tests/test_turn_mounts.py makes it so);
            # either way both answer, as a fresh read of their prompts would.
            answers = await asyncio.gather(*(turn(prompt, name) for name, prompt in nexts.items()))
            for answer, prompt in zip(answers, nexts.values()):
                assert answer.token_ids == (await turn(prompt)).token_ids
        await stack.wait_idle()
        stack.scheduler.pages.check()
    finally:
        await stop_stack(servers)
