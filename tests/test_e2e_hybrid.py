"""The Qwen3.5 hybrid served over real gRPC: greedy tokens equal transformers' fp32 ones, one request at a time
and all at once (padded buckets, chunked prefill, a prompt over 1,000 tokens), under state-slot pressure; the
text and the multimodal layouts give the same tokens; every page, slot and state slot is free at the end."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from tests.conftest import start_stack, stop_stack
from tests.hybrid_model import build_text_model, greedy, save_layouts

pytestmark = pytest.mark.asyncio(loop_scope="session")

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 64, 150, 333, 1100)
STATE_SLOTS = 4  # three for requests: six prompts at once wait for each other's


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(text layout dir, multimodal layout dir, [(prompt, transformers' greedy tokens)])."""
    from tests.hf_reference import hf_tokenizer

    model = build_text_model()
    text_dir, multimodal_dir = save_layouts(model, str(tmp_path_factory.mktemp("qwen3_5")), hf_tokenizer())
    rng = random.Random(0)
    cases = []
    for length in PROMPT_LENGTHS:
        prompt = [rng.randrange(3, 512) for _ in range(length)]
        cases.append((prompt, greedy(model, prompt, NEW_TOKENS)))
    return text_dir, multimodal_dir, cases


def _configs(model_dir: str) -> tuple[ExecutorConfig, PlannerConfig]:
    executor = ExecutorConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        pool_pages=160,
        page_size=16,
        buckets=(1, 2, 4),
        state_slots=STATE_SLOTS,
        row_check=True,
    )
    # A budget that splits the long prompt into chunks, so a chunk continues the state of the one before.
    planner = PlannerConfig(
        model=model_dir, scheduling=SchedulingConfig(row_check=True, prefill_token_budget=256)
    )
    return executor, planner


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def text_stack(hybrid):
    stack, servers = await start_stack(*_configs(hybrid[0]))
    yield stack
    await stop_stack(servers)


async def _all_at_once(stack, cases) -> list[list[int]]:
    async with PlannerClient(stack.addr) as client:
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS))
                for prompt, _ in cases
            )
        )
    return [got.token_ids for got in results]


async def _all_free(stack) -> None:
    await stack.wait_idle()
    scheduler = stack.scheduler
    assert scheduler.pages.free_count == scheduler.pages.total
    assert scheduler.slots.free_count == scheduler.slots.num_slots - 1
    assert scheduler.states.free_count == scheduler.states.total == STATE_SLOTS - 1
    scheduler.states.check()
    assert stack.engine.row_mismatches == 0


async def test_described_state_slots(text_stack):
    assert text_stack.runner.describe().state_slots == STATE_SLOTS
    assert not text_stack.scheduler.prefix_cache  # off for a model with recurrent layers
    async with PlannerClient(text_stack.addr) as client:
        info = await client.server_info()
    assert (info.state_slots, info.free_state_slots) == (
        STATE_SLOTS - 1,
        text_stack.scheduler.states.free_count,
    )


async def test_a_deleted_conversation_gives_its_state_copies_back(text_stack, hybrid):
    """A conversation holding checkpoints' state copies (its turn's end, a pinned prefix): delete gives them back
    with its pages, as ServerInfo shows, and the id's next turn reads its prompt afresh."""
    prompt, expected = hybrid[2][1]
    scheduler = text_stack.scheduler
    options = GenerateOptions(
        token_ids=prompt, max_tokens=NEW_TOKENS, conversation_id="forget-me", shared_prefix={"tokens": 10}
    )
    async with PlannerClient(text_stack.addr) as client:
        await text_stack.wait_idle()
        before = await client.server_info()
        assert (await client.generate_all(options)).token_ids == expected
        await text_stack.wait_idle()
        (conversation,) = [c for c in scheduler.conversations.every() if c.conversation_id == "forget-me"]
        copies, pages = len(conversation.states), len(conversation.pages)
        assert copies == 2 and (await client.server_info()).free_state_slots == before.free_state_slots - 2
        deleted = await client.delete_conversation("forget-me")
        assert (deleted.pages, deleted.snapshot_bytes) == (pages, 0)
        after = await client.server_info()
        assert (after.free_state_slots, after.free_pages) == (before.free_state_slots, before.free_pages)
        scheduler.states.check()
        again = await client.generate_all(options)
        assert (again.token_ids, again.checkpoint, again.reused_tokens) == (expected, "none", 0)
        await client.delete_conversation("forget-me")
    await _all_free(text_stack)


async def test_more_choices_than_state_slots_are_refused_at_once(text_stack, hybrid):
    """n choices stream side by side: more than the pool's state slots is RESOURCE_EXHAUSTED, saying what it needs
    and what there is, and changes nothing; as many as there are run."""
    import grpc

    prompt, expected = hybrid[2][0]
    async with PlannerClient(text_stack.addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate_choices(
                GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS, n=STATE_SLOTS)
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            f"the request's {STATE_SLOTS} choices need {STATE_SLOTS} recurrent-state slots at once and the pool "
            f"has {STATE_SLOTS - 1} (--state-slots {STATE_SLOTS}, slot 0 the sink)"
        )
        assert text_stack.scheduler.idle
        got = await client.generate_choices(
            GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS, n=STATE_SLOTS - 1)
        )
    assert [choice.token_ids for choice in got] == [expected] * (STATE_SLOTS - 1)  # greedy: all alike
    await _all_free(text_stack)


async def test_one_at_a_time_equals_transformers(text_stack, hybrid):
    async with PlannerClient(text_stack.addr) as client:
        for prompt, expected in hybrid[2]:
            got = await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS))
            assert got.token_ids == expected, len(prompt)
    await _all_free(text_stack)


async def test_all_at_once_equals_transformers(text_stack, hybrid):
    """Six requests for three state slots: they wait for each other's, in padded buckets of mixed steps."""
    cases = hybrid[2]
    assert await _all_at_once(text_stack, cases) == [expected for _, expected in cases]
    await _all_free(text_stack)


async def test_multimodal_layout_gives_the_same_tokens(hybrid):
    stack, servers = await start_stack(*_configs(hybrid[1]))
    try:
        cases = hybrid[2]
        assert await _all_at_once(stack, cases) == [expected for _, expected in cases]
        await _all_free(stack)
    finally:
        await stop_stack(servers)


async def test_aborts_free_their_state_slots(text_stack, hybrid):
    """Two long requests aborted, one decoding and one that may still wait for a state slot, while others run:
    the others keep transformers' tokens, and every state slot comes back."""
    cases = hybrid[2]
    async with PlannerClient(text_stack.addr) as client:
        decoding = client.generate(
            GenerateOptions(token_ids=cases[0][0], max_tokens=200, request_id="long-0")
        )
        await decoding.__anext__()
        finished = asyncio.gather(
            *(client.generate_all(GenerateOptions(token_ids=p, max_tokens=NEW_TOKENS)) for p, _ in cases[2:4])
        )
        other = asyncio.ensure_future(
            client.generate_all(GenerateOptions(token_ids=cases[1][0], max_tokens=200, request_id="long-1"))
        )
        for _ in range(500):  # until the planner has taken it in
            if await client.abort("long-1"):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("long-1 was never running")
        assert await client.abort("long-0")
        assert [r async for r in decoding][-1].finish_reason == 3  # FINISH_REASON_ABORT
        assert (await other).finish_reason == "abort"
        assert [got.token_ids for got in await finished] == [expected for _, expected in cases[2:4]]
    await _all_free(text_stack)


async def test_conversation_resumes_from_checkpoints_with_state_copies(text_stack, hybrid):
    """Each turn's end is a checkpoint holding its state copy (in the middle of a page here). Turn 2 resumes from
    turn 1's (its pages and the copy of its state) and turn 3, its history edited before turn 2's checkpoint,
    from turn 1's again: each gives the tokens (and logprobs) of a fresh read of its whole history. Three
    requests at once then need every state slot: the conversation's copies give theirs back under that
    pressure. A pinned prefix inside a prompt holds a copy too, and a history edited after it resumes from it."""
    model = build_text_model()
    prompt, first_answer = hybrid[2][1]
    second = prompt + first_answer + [7, 8, 9]
    edited = prompt + first_answer + [7, 8, 10, 11]
    stored = len(prompt) + NEW_TOKENS - 1  # turn 1's state: the prompt and all but its last token (24)
    scheduler = text_stack.scheduler
    async with PlannerClient(text_stack.addr) as client:

        async def turn(history: list[int], conversation: str = "chat"):
            options = GenerateOptions(
                token_ids=history, max_tokens=NEW_TOKENS, conversation_id=conversation, logprobs=True
            )
            return await client.generate_all(options)

        async def assert_fresh_read(got, history: list[int]) -> None:
            """The tokens, and their logprobs (which a state not copied would move), of a read of it all."""
            fresh = await turn(history, conversation="")
            assert got.token_ids == fresh.token_ids == greedy(model, history, NEW_TOKENS)
            assert [t.chosen.logprob for t in got.logprobs] == pytest.approx(
                [t.chosen.logprob for t in fresh.logprobs], abs=2e-5
            )

        first = await turn(prompt)
        assert first.token_ids == first_answer and first.reused_tokens == 0
        await text_stack.wait_idle()
        (conversation,) = [c for c in scheduler.conversations.every() if c.conversation_id == "chat"]
        assert list(conversation.states) == [stored] and scheduler.states.free_count == STATE_SLOTS - 2
        got = await turn(second)
        await assert_fresh_read(got, second)
        assert (got.reused_tokens, got.checkpoint, got.diverged_at) == (stored, f"checkpoint@{stored}", -1)
        await text_stack.wait_idle()
        assert sorted(conversation.states) == [stored, len(second) + NEW_TOKENS - 1]
        got = await turn(edited)
        await assert_fresh_read(got, edited)
        assert (got.reused_tokens, got.checkpoint, got.diverged_at) == (
            stored,
            f"checkpoint@{stored}",
            len(prompt) + NEW_TOKENS + 2,
        )
        await text_stack.wait_idle()
        assert sorted(conversation.states) == [stored, len(edited) + NEW_TOKENS - 1]
    cases = hybrid[2][: STATE_SLOTS - 1]
    assert await _all_at_once(text_stack, cases) == [expected for _, expected in cases]
    await _all_free(text_stack)
    assert not conversation.states
    async with PlannerClient(text_stack.addr) as client:
        # A pinned prefix inside the prompt keeps a copy of the state there: a history edited after it, before
        # the turn's end, resumes from the pin.
        pinned = GenerateOptions(
            token_ids=prompt, max_tokens=NEW_TOKENS, conversation_id="pin", shared_prefix={"tokens": 10}
        )
        got = await client.generate_all(pinned)
        assert (got.token_ids, got.pinned_prefix, got.pin_note) == (first_answer, 10, "")
        await text_stack.wait_idle()
        (pinned_chat,) = [c for c in scheduler.conversations.every() if c.conversation_id == "pin"]
        assert sorted(pinned_chat.states) == [10, stored] and pinned_chat.retention.pinned == 10
        edited = prompt[:12] + [4, 4, 4]
        got = await turn(edited, conversation="pin")
        await assert_fresh_read(got, edited)
        assert (got.reused_tokens, got.checkpoint, got.diverged_at) == (10, "checkpoint@10", 12)
    # State pressure takes the end's copy, never the pin's (retention never evicts a pin): the conversation keeps
    # the pin's copy and its pages, one state slot fewer for the requests (they wait for each other's).
    assert await _all_at_once(text_stack, cases) == [expected for _, expected in cases]
    await text_stack.wait_idle()
    assert list(pinned_chat.states) == [10] and pinned_chat.retention.pinned == 10 and pinned_chat.pages
    assert scheduler.states.free_count == STATE_SLOTS - 2
    async with PlannerClient(text_stack.addr) as client:  # its next turn resumes from the pin, as pinned
        edited = prompt[:12] + [5, 5, 5]
        options = GenerateOptions(token_ids=edited, max_tokens=NEW_TOKENS, conversation_id="pin")
        got = await client.generate_all(options)
        assert (got.reused_tokens, got.checkpoint, got.diverged_at) == (10, "checkpoint@10", 12)
        assert got.token_ids == greedy(model, edited, NEW_TOKENS)
        await client.delete_conversation("pin")
    await _all_free(text_stack)


async def test_a_later_turn_pins_a_checkpoint_it_resumed_past_or_its_answer_says_why_not(text_stack, hybrid):
    """A hybrid keeps a pin only with the state at it: a turn resuming past a prefix where no copy was kept
    answers pinned_prefix 0 and why; one naming a position its conversation holds a copy at pins that copy."""
    prompt, answer = hybrid[2][1]
    stored = len(prompt) + NEW_TOKENS - 1  # the first turn's end: its checkpoint, with a state copy

    def options(history: list[int], **fields) -> GenerateOptions:
        return GenerateOptions(token_ids=history, max_tokens=NEW_TOKENS, conversation_id="late-pin", **fields)

    async with PlannerClient(text_stack.addr) as client:
        first = await client.generate_all(options(prompt))
        assert (first.token_ids, first.pinned_prefix) == (answer, None)  # no shared prefix asked: no report
        history = prompt + answer + [4, 4]
        past = await client.generate_all(options(history, shared_prefix={"tokens": 10}))
        assert (past.checkpoint, past.pinned_prefix) == (f"checkpoint@{stored}", 0)
        assert past.pin_note.startswith("the conversation keeps no recurrent state at the prefix")
        history += past.token_ids + [5, 5]
        at_copy = await client.generate_all(options(history, shared_prefix={"tokens": stored}))
        assert (at_copy.pinned_prefix, at_copy.pin_note) == (stored, "")
        assert at_copy.token_ids == greedy(build_text_model(), history, NEW_TOKENS)
        (conversation,) = [
            c for c in text_stack.scheduler.conversations.every() if c.conversation_id == "late-pin"
        ]
        assert conversation.retention.pinned == stored and stored in conversation.states
        await client.delete_conversation("late-pin")
    await _all_free(text_stack)


async def test_a_turn_a_stop_string_ends_keeps_a_checkpoint_at_its_prompts_end(text_stack, hybrid):
    """A stop string ends a turn steps after its state read on, so the turn's end keeps no state: the copy at
    its prompt's end is the conversation's checkpoint (it kept none, and every next turn read it all again)."""
    model = build_text_model()
    prompt, first_answer = hybrid[2][1]
    decode = text_stack.planner.tokenizer.decode
    stop = decode(first_answer[:3])[len(decode(first_answer[:2])) :]
    assert stop and stop not in decode(first_answer[:2]), "the test needs the third token's own text"
    async with PlannerClient(text_stack.addr) as client:
        first = await client.generate_all(
            GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS, conversation_id="stopped", stop=[stop])
        )
        assert first.finish_reason == "stop" and first.stop_string == stop
        await text_stack.wait_idle()
        (conversation,) = [
            c for c in text_stack.scheduler.conversations.every() if c.conversation_id == "stopped"
        ]
        assert len(prompt) in conversation.states
        history = prompt + first.token_ids + [7, 8, 9]
        got = await client.generate_all(
            GenerateOptions(token_ids=history, max_tokens=NEW_TOKENS, conversation_id="stopped")
        )
    assert (got.reused_tokens, got.checkpoint) == (len(prompt), f"checkpoint@{len(prompt)}")
    assert got.token_ids == greedy(model, history, NEW_TOKENS)
    await _all_at_once(text_stack, hybrid[2][: STATE_SLOTS - 1])  # state pressure takes the copies back
    await _all_free(text_stack)


async def test_row_check_soak_under_kv_and_state_pressure(hybrid):
    """bench/soak's random requests (greedy and seeded, 15% abandoned by their client) on few pages and few
    state slots, prefill in chunks of 24 tokens: every row a step reads equals the planner's mirror, answers
    under churn equal the same request alone, and every page, slot and state slot is free at the end."""
    from bench.soak import one_request

    executor, planner = _configs(hybrid[0])
    executor.pool_pages, executor.state_slots = 24, 6
    planner.scheduling.prefill_token_budget = 24
    stack, servers = await start_stack(executor, planner)
    rng = random.Random(7)
    try:
        async with PlannerClient(stack.addr) as client:
            results = await asyncio.gather(*(one_request(client, rng, i, 512) for i in range(40)))
            await stack.wait_idle(60.0)
            assert stack.engine.row_mismatches == 0 and stack.engine.steps > 50
            scheduler = stack.scheduler
            assert scheduler.pages.free_count == scheduler.pages.total
            assert scheduler.slots.free_count == scheduler.slots.num_slots - 1
            assert scheduler.states.free_count == scheduler.states.total == 5
            for fields, tokens, finished in results:
                if finished:
                    alone = await client.generate_all(
                        GenerateOptions(**{**fields, "request_id": fields["request_id"] + "-alone"})
                    )
                    assert tokens == alone.token_ids
    finally:
        await stop_stack(servers)
