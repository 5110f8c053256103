"""Greedy tokens through the real planner and executor over gRPC equal Hugging Face's, token for token."""

from __future__ import annotations

import asyncio

import pytest

from planner_svc.client import GenerateOptions, PlannerClient
from tests.conftest import PARITY_TOKENS

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_chat_prompt_ids_equal_transformers(smol_stack):
    from planner_svc.tokenizer import chat_ids as planner_chat_ids
    from tests.hf_reference import chat_ids, chat_prompts

    for chat in chat_prompts():
        assert planner_chat_ids(smol_stack.planner.tokenizer, chat, {}) == chat_ids(chat)


async def test_one_at_a_time_equals_transformers(smol_stack, hf_answers):
    async with PlannerClient(smol_stack.addr) as client:
        for chat, expected in hf_answers:
            got = await client.generate_all(GenerateOptions(chat=chat, max_tokens=PARITY_TOKENS))
            assert got.token_ids == expected
            assert got.finish_reason == ("stop" if expected[-1] == 2 else "length")
            # the answer's text, without the stop token's "<|im_end|>"
            assert got.text == smol_stack.planner.tokenizer.decode(got.token_ids, skip_special_tokens=True)
            assert "<|im_end|>" not in got.text
    assert smol_stack.engine.row_mismatches == 0


async def test_all_at_once_equals_transformers(smol_stack, hf_answers):
    """Batched decode in padded buckets, long prompts crossing many pages, chunked prefill."""
    scheduler = smol_stack.scheduler
    await smol_stack.wait_idle()
    async with PlannerClient(smol_stack.addr) as client:
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(chat=chat, max_tokens=PARITY_TOKENS))
                for chat, _ in hf_answers
            )
        )
    for got, (_, expected) in zip(results, hf_answers):
        assert got.token_ids == expected
    assert max(got.prompt_tokens for got in results) > 1000
    assert smol_stack.engine.row_mismatches == 0
    await smol_stack.wait_idle()  # the last step's commit frees the pages and slots behind it
    kept = {page for conversation in scheduler.conversations.every() for page in conversation.pages}
    assert scheduler.pages.free_count == scheduler.pages.total - len(kept)  # earlier tests' conversations'
    assert scheduler.slots.free_count == scheduler.slots.num_slots - 1
