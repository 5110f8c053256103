"""What a client sees over real gRPC: seeded sampling, bad input refused cleanly, aborts and disconnects."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from planner_svc.client import GenerateOptions, PlannerClient
from protos import client_pb2
from protos.wire import unpack_i32

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "user", "content": "Write a short poem about autumn leaves."}]


async def test_seeded_sampling_repeats_and_seeds_differ(smol_stack):
    async with PlannerClient(smol_stack.addr) as client:
        params = dict(chat=CHAT, max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True)
        first, second, other = await asyncio.gather(
            client.generate_all(GenerateOptions(seed=7, **params)),
            client.generate_all(GenerateOptions(seed=7, **params)),
            client.generate_all(GenerateOptions(seed=8, **params)),
        )
        alone = await client.generate_all(GenerateOptions(seed=7, **params))  # a different batch: same tokens
    assert first.token_ids == second.token_ids == alone.token_ids
    assert other.token_ids != first.token_ids
    assert len(first.token_ids) == 16 and first.finish_reason == "length"


async def test_unseeded_requests_draw_their_own_seeds_and_seed_0_is_a_seed(smol_stack):
    """Unset on the wire, the planner draws the seed: two unseeded requests (40 tokens at temperature 1, where
    a collision is negligible) sample differently, while an explicit seed, 0 too, repeats exactly."""
    params = dict(text="Once upon a time", max_tokens=40, temperature=1.0, ignore_eos=True)
    async with PlannerClient(smol_stack.addr) as client:
        unseeded = [await client.generate_all(GenerateOptions(**params)) for _ in range(2)]
        zero = [await client.generate_all(GenerateOptions(seed=0, **params)) for _ in range(2)]
    assert unseeded[0].token_ids != unseeded[1].token_ids
    assert zero[0].token_ids == zero[1].token_ids and len(zero[0].token_ids) == 40


async def test_an_unseeded_request_reports_the_seed_it_drew_which_repeats_it(smol_stack):
    """The seed the planner drew comes back (GenerateResponse.seed, on the first message and the last): sent as
    the seed, it repeats the tokens. A seeded request reports its own (0 too); with n, every choice reports the
    request's seed, which repeats them all."""
    params = dict(text="Once upon a time", max_tokens=24, temperature=1.0, ignore_eos=True)
    async with PlannerClient(smol_stack.addr) as client:
        responses = [response async for response in client.generate(GenerateOptions(**params))]
        tokens = [token for response in responses for token in unpack_i32(response.token_ids).tolist()]
        first, last = responses[0], responses[-1]
        assert first.HasField("seed") and last.HasField("seed") and first.seed == last.seed
        assert not any(response.HasField("seed") for response in responses[1:-1])
        drawn = last.seed
        assert 0 <= drawn < 2**53  # exact as a JSON number (the HTTP API's deltaserve.seed)
        again = await client.generate_all(GenerateOptions(seed=drawn, **params))
        other = await client.generate_all(GenerateOptions(**params))  # another draw
        zero = await client.generate_all(GenerateOptions(seed=0, **params))
        pair = await client.generate_choices(GenerateOptions(n=2, **params))
        repeated = await client.generate_choices(GenerateOptions(n=2, seed=pair[0].seed, **params))
    assert (again.token_ids, again.seed) == (tokens, drawn)
    assert other.seed != drawn and other.token_ids != tokens
    assert zero.seed == 0
    assert pair[0].seed is not None and [c.seed for c in pair] == [pair[0].seed] * 2
    assert [c.token_ids for c in repeated] == [c.token_ids for c in pair]


async def test_text_and_token_id_prompts(smol_stack):
    async with PlannerClient(smol_stack.addr) as client:
        by_text = await client.generate_all(GenerateOptions(text="The capital of France is", max_tokens=5))
        ids = smol_stack.planner.tokenizer("The capital of France is")["input_ids"]
        by_ids = await client.generate_all(GenerateOptions(token_ids=ids, max_tokens=5))
        info = await client.model_info()
        server = await client.server_info()
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_tokens == len(ids)
    assert info.vocab_size == 49152 and info.max_seq_len == 8192 and info.eos_token_id == 2
    assert server.pool_pages == smol_stack.scheduler.pages.total
    assert server.state_slots == server.free_state_slots == 0  # a model with no recurrent layers
    assert "executors" not in client_pb2.ServerInfo.DESCRIPTOR.fields_by_name  # internal topology: not told


async def expect_status(coro, code: grpc.StatusCode, message: str):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await coro
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()


@pytest.mark.parametrize(
    "fields, code, message",
    [
        (dict(text="", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (dict(chat=[], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (dict(token_ids=[1] * 9000, max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "context is 8192"),
        (dict(text="hi", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be positive"),
        (
            dict(text="hi", max_tokens=4, top_p=0.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be in (0, 1]",
        ),
        (
            dict(text="hi", max_tokens=4, top_p=1.5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be in (0, 1]",
        ),
        (dict(text="hi", max_tokens=4, temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(text="hi", max_tokens=4, top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(token_ids=[5, 49152], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "token id 49152"),
        (dict(token_ids=[5, -1], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "token id -1"),
        (  # refused as its turn mounts: the conversation it opened goes too
            dict(token_ids=[5, 49152], max_tokens=4, conversation_id="refused"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token id 49152",
        ),
    ],
)
async def test_bad_input_is_refused_and_changes_nothing(smol_stack, fields, code, message):
    await smol_stack.wait_idle()
    pages = smol_stack.scheduler.pages.free_count
    async with PlannerClient(smol_stack.addr) as client:
        await expect_status(client.generate_all(GenerateOptions(**fields)), code, message)
    assert smol_stack.scheduler.idle and smol_stack.scheduler.pages.free_count == pages
    turns = smol_stack.planner.turns
    assert turns.find("default", "refused") == (None, None) and ("default", "refused") not in turns._locks


async def test_duplicate_request_id_and_unknown_abort(smol_stack):
    async with PlannerClient(smol_stack.addr) as client:
        stream = client.generate(
            GenerateOptions(text="Count to one hundred:", max_tokens=200, ignore_eos=True, request_id="dup")
        )
        first = await stream.__anext__()
        assert first.request_id == "dup"
        await expect_status(
            client.generate_all(GenerateOptions(text="hello", max_tokens=2, request_id="dup")),
            grpc.StatusCode.ALREADY_EXISTS,
            "already running",
        )
        assert await client.abort("no-such-request") is False  # idempotent, not an error
        assert await client.abort("dup") is True
        rest = [r async for r in stream]
        assert rest[-1].finish_reason == 3  # FINISH_REASON_ABORT
        assert await client.abort("dup") is False
    await smol_stack.wait_idle()


async def test_client_disconnect_frees_pages_and_slot(smol_stack):
    await smol_stack.wait_idle()
    scheduler = smol_stack.scheduler
    pages, slots = scheduler.pages.free_count, scheduler.slots.free_count
    async with PlannerClient(smol_stack.addr) as client:
        stream = client.generate(
            GenerateOptions(text="Tell me everything about the ocean.", max_tokens=500, ignore_eos=True)
        )
        async for response in stream:
            if len(response.token_ids) or scheduler.running:
                break
        assert scheduler.pages.free_count < pages
        await stream.aclose()  # the client goes away mid-stream
    await smol_stack.wait_idle()
    assert scheduler.pages.free_count == pages and scheduler.slots.free_count == slots


async def test_streams_written_one_a_step_still_get_every_token(smol_stack):
    """With one stream write allowed per step, four requests' tokens pile up and go out joined; nothing is lost
    and each stream still ends with its finish reason."""
    from planner_svc.streaming import StreamBudget

    engine = smol_stack.engine
    prompts = [f"Count from {n} to {n + 20}:" for n in range(4)]
    async with PlannerClient(smol_stack.addr) as client:
        free = await asyncio.gather(
            *(client.generate_all(GenerateOptions(text=p, max_tokens=8, ignore_eos=True)) for p in prompts)
        )
        saved, engine.stream_budget = (
            engine.stream_budget,
            StreamBudget(min_writes=1, writes=1.0, max_writes=1),
        )
        try:
            messages = [0] * len(prompts)

            async def count_messages(index: int) -> list[int]:
                ids = []
                async for response in client.generate(
                    GenerateOptions(text=prompts[index], max_tokens=8, ignore_eos=True)
                ):
                    messages[index] += 1
                    ids += list(unpack_i32(response.token_ids))
                return ids

            tight = await asyncio.gather(*(count_messages(i) for i in range(len(prompts))))
        finally:
            engine.stream_budget = saved
    assert tight == [g.token_ids for g in free]
    assert sum(messages) < 4 * 8  # some messages carried several tokens
