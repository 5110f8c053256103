"""A layer split over real gRPC, each stage its own process on the CPU (gloo): greedy tokens equal
transformers' through 2 and 3 stages (uneven splits of SmolLM2's 30 layers), one at a time and all at once,
with the row check on every stage at 0 mismatches; a conversation parked under one split resumes under another
(2 -> 3 -> 1) after every service restarted, with the same tokens as never parked."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from protos import client_pb2
from tests.conftest import PARITY_TOKENS, SMOL_BUCKETS, start_stack, stop_stack
from tests.split_stages import StageGroup, start_group_planner

pytestmark = pytest.mark.asyncio(loop_scope="session")

TWO = [(0, 13), (13, 30)]
THREE = [(0, 7), (7, 19), (19, 30)]
CONVERSATION = "split-chat"
TURN_TOKENS = 12


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("split-cache"))


async def start_cache(cache_dir: str):
    cache = await start_cache_server(cache_dir, budget_bytes=1 << 30)
    return cache, f"127.0.0.1:{cache.port}"


async def parity(stack, answers, at_once: bool) -> None:
    """Greedy tokens equal transformers' (`answers`: chats and theirs), every stage's row check at 0."""
    async with PlannerClient(stack.addr) as client:
        options = [GenerateOptions(chat=chat, max_tokens=PARITY_TOKENS) for chat, _ in answers]
        if at_once:
            results = await asyncio.gather(*(client.generate_all(o) for o in options))
        else:
            results = [await client.generate_all(o) for o in options]
    for got, (_, expected) in zip(results, answers, strict=True):
        assert got.token_ids == expected
    assert stack.engine.row_mismatches == 0


async def turn(stack, chat: list[dict], conversation: str = CONVERSATION) -> tuple[list[int], str]:
    """One conversation turn: its tokens, and what it mounted (empty unless it reused its KV)."""
    async with PlannerClient(stack.addr) as client:
        got = await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=TURN_TOKENS, conversation_id=conversation)
        )
    return got.token_ids, got.checkpoint if got.reused_tokens else ""


def follow_up(stack, chat: list[dict], answer: list[int], question: str) -> list[dict]:
    text = stack.planner.tokenizer.decode(answer, skip_special_tokens=True)
    return [*chat, {"role": "assistant", "content": text}, {"role": "user", "content": question}]


async def park(stack, conversation: str = CONVERSATION) -> None:
    async with PlannerClient(stack.addr) as client:
        await client._stub.Park(client_pb2.ParkRequest(conversation_id=conversation))


async def test_splits_equal_transformers_and_snapshots_cross_splits(tmp_path, cache_dir, hf_answers):
    from tests.hf_reference import chat_ids, hf_greedy

    chat = [{"role": "user", "content": "Name three rivers of Europe."}]
    # Two stages: parity one at a time and all at once, then park a conversation.
    cache, cache_addr = await start_cache(cache_dir)
    group = StageGroup(tmp_path, TWO, cache_addr)
    try:
        group.wait_listening()
        stack, planner = await start_group_planner(group.addresses, cache_addr)
        # Lean for CI: a short prompt and a long one (chunked prefill over many pages) alone, then the five
        # short ones at once.
        await parity(stack, [hf_answers[0], hf_answers[5]], at_once=False)
        await parity(stack, hf_answers[:5], at_once=True)
        await stack.wait_idle()
        assert stack.scheduler.pages.free_count == stack.scheduler.pages.total
        first, _ = await turn(stack, chat)
        await park(stack)
        chat2 = follow_up(stack, chat, first, "Which is the longest?")
        await planner.stop(None)
    finally:
        group.stop()
    await cache.stop(None)

    # Every service restarted; three stages: the parked conversation resumes from its snapshot.
    cache, cache_addr = await start_cache(cache_dir)
    group = StageGroup(tmp_path, THREE, cache_addr)
    try:
        group.wait_listening()
        stack, planner = await start_group_planner(group.addresses, cache_addr)
        second, checkpoint = await turn(stack, chat2)
        assert checkpoint.startswith(("snapshot@", "checkpoint@")), checkpoint
        assert second == hf_greedy(chat_ids(chat2), TURN_TOKENS)
        await parity(stack, hf_answers[1:2], at_once=False)
        await parity(stack, hf_answers[:4], at_once=True)
        await park(stack)
        chat3 = follow_up(stack, chat2, second, "And the shortest?")
        await planner.stop(None)
    finally:
        group.stop()
    await cache.stop(None)

    # One whole executor: the snapshot parked by three stages restores.
    cache, cache_addr = await start_cache(cache_dir)
    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", dtype="float32", pool_pages=400, buckets=SMOL_BUCKETS, cache=cache_addr),
        PlannerConfig(cache=cache_addr, scheduling=SchedulingConfig(prefill_token_budget=512)),
    )
    try:
        third, checkpoint = await turn(stack, chat3)
        assert checkpoint.startswith(("snapshot@", "checkpoint@")), checkpoint
        assert third == hf_greedy(chat_ids(chat3), TURN_TOKENS)
    finally:
        await stop_stack([*servers, cache])
