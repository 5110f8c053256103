"""Snapshots of a Qwen3.5 hybrid conversation through the cache service, over real gRPC: park carries each
checkpoint's recurrent state with the pages (shards of two layers: one of gated delta nets only, one of both
kinds), a resume brings them back byte for byte, and after a restart of every service the conversation resumes
from its snapshot with the tokens of a fresh read of its whole history: under a layer split of two stages (each
its own process, gloo), which also gives transformers' greedy tokens one at a time and all at once and soaks
with the row check at 0 mismatches, and then, parked by those stages, under three."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from bench.soak import one_request
from cache_svc.server import start_cache_server
from executor_svc.kernels import interpreting
from planner_svc.client import GenerateOptions, PlannerClient
from tests.conftest import stop_stack
from tests.hybrid_model import build_text_model, greedy, save_layouts, start_with_cache
from tests.split_stages import StageGroup, start_group_planner

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(
        not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
    ),
]
DEVICE = "cpu" if interpreting() else "cuda"  # on a GPU (TRITON_INTERPRET=0): the copies on the card
# A lost or stale state moves the logprobs by ~6e-4 on the CPU; a card's kernels may differ by more between a
# read of it all and a resumed one (not measured yet), so there the tokens and the bytes are the checks.
LOGPROBS_ABS = 2e-5 if DEVICE == "cpu" else 1e-3

NEW_TOKENS = 6
STATE_SLOTS = 5
# A stage of one gated delta net (no KV layer) and one of the rest (two of them and the full-attention layer):
# each reads part of the first shard of two layers parked whole. Then three stages, the last of the
# full-attention layer only (no state layer), the middle and the last each reading part of a shard parked by two.
TWO = [(0, 1), (1, 4)]
THREE = [(0, 2), (2, 3), (3, 4)]


async def _start(model_dir: str, cache_dir: str):
    stack, servers, cache = await start_with_cache(
        model_dir, cache_dir, STATE_SLOTS, row_check=True, device=DEVICE, shard_layers=2
    )
    return stack, [*servers, cache]


async def _start_split(model_dir: str, cache_dir: str, log_dir, split: list[tuple[int, int]]):
    cache = await start_cache_server(cache_dir, budget_bytes=1 << 30)
    address = f"127.0.0.1:{cache.port}"
    flags = ("--model", model_dir, "--device", DEVICE, "--dtype", "float32", "--pool-pages", "64")
    flags += (
        "--page-size",
        "16",
        "--buckets",
        "1,2,4",
        "--state-slots",
        str(STATE_SLOTS),
        "--shard-layers",
        "2",
    )
    flags += ("--stage-backend", "gloo")  # on a card, two stages of one process each: NCCL refuses them
    group = StageGroup(log_dir, split, address, flags=flags)
    try:
        group.wait_listening()
        stack, planner = await start_group_planner(group.addresses, address, model=model_dir)
    except BaseException:
        group.stop()
        await cache.stop(None)
        raise
    return stack, group, [planner, cache]


def _states(stack, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pool = stack.runner.state_pool
    return pool.conv[:, slots].clone(), pool.recurrent[:, slots].clone()


def _conversation(stack):
    (conversation,) = [c for c in stack.scheduler.conversations.every() if c.conversation_id == "chat"]
    return conversation


async def _all_free_but_chat(stack) -> None:
    """Idle, every page and state slot is free but those the conversation holds (none once parked)."""
    await stack.wait_idle()
    scheduler, conversation = stack.scheduler, _conversation(stack)
    assert scheduler.pages.free_count == scheduler.pages.total - len(conversation.pages)
    assert scheduler.states.free_count == STATE_SLOTS - 1 - len(conversation.states)
    scheduler.states.check()


async def test_park_restart_resume_equals_a_fresh_read(tmp_path):
    from tests.hf_reference import hf_tokenizer

    model = build_text_model()
    model_dir, _ = save_layouts(model, str(tmp_path / "model"), hf_tokenizer())
    prompt = [(7 * i) % 500 + 3 for i in range(21)]
    stack, servers = await _start(model_dir, str(tmp_path / "cache"))
    try:
        async with PlannerClient(stack.addr) as client:
            first = await client.generate_all(
                GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS, conversation_id="chat")
            )
            second_prompt = prompt + first.token_ids + [5, 6]
            await client.generate_all(
                GenerateOptions(token_ids=second_prompt, max_tokens=NEW_TOKENS, conversation_id="chat")
            )
            await stack.wait_idle()
            conversation = _conversation(stack)
            positions = sorted(conversation.states)
            assert len(positions) == 2 and positions == conversation.retention.positions
            states = _states(stack, [conversation.states[p] for p in positions])
            pages = conversation.pages
            kv = stack.runner.kv_pool.k[:, pages].clone(), stack.runner.kv_pool.v[:, pages].clone()
            assert (await client.park("chat")).bytes > 0
            assert not conversation.states and stack.scheduler.states.free_count == STATE_SLOTS - 1
            resumed = await client.resume("chat")  # the planner knows both checkpoints: both states return
            assert list(resumed.checkpoints) == positions
            pages = conversation.pages
            assert torch.equal(stack.runner.kv_pool.k[:, pages], kv[0])
            assert torch.equal(stack.runner.kv_pool.v[:, pages], kv[1])
            back = _states(stack, [conversation.states[p] for p in positions])
            assert torch.equal(back[0], states[0]) and torch.equal(back[1], states[1])  # byte for byte
            assert (await client.park("chat")).bytes > 0
            await _all_free_but_chat(stack)
            history = list(conversation.tokens) + [9, 10, 11]
    finally:
        await stop_stack(servers)
    # Every service restarted, the model split in two stages: greedy tokens equal transformers', then the
    # conversation resumes from the snapshot parked whole, each stage reading its layers' part.
    stack, group, servers = await _start_split(model_dir, str(tmp_path / "cache"), tmp_path, TWO)
    try:
        async with PlannerClient(stack.addr) as client:
            prompts = [[(11 * i + n) % 500 + 3 for i in range(n)] for n in (5, 21, 40)]  # up to three pages
            expected = [greedy(model, p, NEW_TOKENS) for p in prompts]
            options = [GenerateOptions(token_ids=p, max_tokens=NEW_TOKENS) for p in prompts]
            assert [(await client.generate_all(o)).token_ids for o in options] == expected
            all_at_once = await asyncio.gather(*(client.generate_all(o) for o in options))
            assert [r.token_ids for r in all_at_once] == expected
            # A soak under KV and state-slot pressure (20 requests, 4 state slots), some abandoned: every stage's
            # row check at 0, every page and state slot free after.
            rng = random.Random(20)
            await asyncio.gather(*(one_request(client, rng, i, 500, longest=40) for i in range(20)))
            await stack.wait_idle()
            scheduler = stack.scheduler
            assert stack.engine.row_mismatches == 0 and scheduler.pages.free_count == scheduler.pages.total
            assert scheduler.states.free_count == STATE_SLOTS - 1
            await _resumes_as_a_fresh_read(client, model, history, positions[-1])
            await stack.wait_idle()
            assert stack.engine.row_mismatches == 0
            newest = len(history) + NEW_TOKENS - 1
            assert sorted(_conversation(stack).states) == [*positions, newest]  # the restart lost none
            assert (await client.park("chat")).bytes > 0  # each stage's layers, put whole by the first
            await _all_free_but_chat(stack)
            history = list(_conversation(stack).tokens) + [12, 13]
    finally:
        group.stop()
        await stop_stack(servers)
    # Three stages: the snapshot parked by the two restores.
    stack, group, servers = await _start_split(model_dir, str(tmp_path / "cache"), tmp_path, THREE)
    try:
        async with PlannerClient(stack.addr) as client:
            await _resumes_as_a_fresh_read(client, model, history, newest)
            await _all_free_but_chat(stack)
            assert stack.engine.row_mismatches == 0
    finally:
        group.stop()
        await stop_stack(servers)


async def _resumes_as_a_fresh_read(client: PlannerClient, model, history: list[int], parked_at: int) -> None:
    """The conversation resumed from its snapshot at `parked_at` gives the tokens of a read of its whole history
    and transformers', and the same logprobs (a state lost would move them)."""
    got, fresh = [
        await client.generate_all(
            GenerateOptions(token_ids=history, max_tokens=NEW_TOKENS, conversation_id=name, logprobs=True)
        )
        for name in ("chat", "")  # resumed from the snapshot; a read of it all
    ]
    assert got.token_ids == fresh.token_ids == greedy(model, history, NEW_TOKENS)
    assert [t.chosen.logprob for t in got.logprobs] == pytest.approx(
        [t.chosen.logprob for t in fresh.logprobs], abs=LOGPROBS_ABS
    )
    assert (got.checkpoint, got.reused_tokens) == (f"snapshot@{parked_at}", parked_at)


async def test_a_resume_short_of_state_slots_takes_an_idle_conversations_copy(tmp_path):
    """Every state slot held by idle conversations' checkpoints: a resume takes the least recently used one's
    copy back, as admission does, instead of refusing (UNAVAILABLE) and reading the whole prompt again."""
    from tests.hf_reference import hf_tokenizer

    model_dir, _ = save_layouts(build_text_model(), str(tmp_path / "model"), hf_tokenizer())
    stack, servers = await _start(model_dir, str(tmp_path / "cache"))
    try:
        async with PlannerClient(stack.addr) as client:
            for name in ("a", "b", "c", "d", "e"):
                prompt = [(7 * i + len(name)) % 500 + 3 for i in range(21)]
                await client.generate_all(
                    GenerateOptions(token_ids=prompt, max_tokens=2, conversation_id=name)
                )
                if name == "c":
                    await stack.wait_idle()
                    assert (await client.park("c")).bytes > 0
            await stack.wait_idle()
            assert stack.scheduler.states.free_count == 0, "the test needs every slot held"
            resumed = await client.resume("c")
            assert resumed.tokens > 0 and list(resumed.checkpoints)
    finally:
        await stop_stack(servers)
