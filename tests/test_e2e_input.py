"""Issue 14's input cases over real gRPC: bad sampling values, invalid UTF-8, an oversized prompt, duplicate
request ids, max_tokens beyond the context and admission past a request waiting for pages, and a fuzzed loop.
Each asserts the status and message, that no page or slot leaked, and that a normal request afterwards gets
the same tokens as before."""

from __future__ import annotations

import asyncio
import math
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planner_svc.client import GenerateOptions, PlannerClient
from protos import client_pb2
from protos.wire import pack_i32, unpack_i32

pytestmark = pytest.mark.asyncio(loop_scope="session")

NORMAL = GenerateOptions(text="The capital of France is", max_tokens=6)
GENERATE = "/deltaserve.v1.Planner/Generate"
_baseline: dict[str, list[int]] = {}


async def state(stack, client: PlannerClient) -> tuple[int, int, int, int]:
    """Pages free or held by a conversation (KV pressure may drop those), free slots, running, waiting."""
    await stack.wait_idle()
    info = await client.server_info()
    kept = sum(c.pages for c in await client.conversations())
    return info.free_pages + kept, info.free_slots, info.running, info.waiting


async def normal_tokens(client: PlannerClient) -> list[int]:
    tokens = (await client.generate_all(NORMAL)).token_ids
    _baseline.setdefault("normal", tokens)
    return tokens


async def raw_generate(addr: str, data: bytes) -> list[client_pb2.GenerateResponse]:
    """A Generate call whose request bytes are sent as they are (invalid UTF-8 included)."""
    async with grpc.aio.insecure_channel(addr) as channel:
        call = channel.unary_stream(
            GENERATE,
            request_serializer=lambda b: b,
            response_deserializer=client_pb2.GenerateResponse.FromString,
        )
        return [response async for response in call(data, timeout=60)]


async def expect(coro, code: grpc.StatusCode, message: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await coro
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details(), caught.value.details()
    return caught.value.details()


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(temperature=math.inf),
            "sampling.temperature must be finite and in [0, 100] (0 is greedy), got inf",
        ),
        (
            dict(temperature=math.nan),
            "sampling.temperature must be finite and in [0, 100] (0 is greedy), got nan",
        ),
        (dict(temperature=-math.inf), "got -inf"),
        (dict(top_p=math.nan), "sampling.top_p must be in (0, 1], got nan"),
        (dict(top_p=math.inf), "sampling.top_p must be in (0, 1], got inf"),
        (dict(top_k=-5), "sampling.top_k must be >= 0 (0 is no cut), got -5"),
        (
            dict(stop_token_ids=[2, 10**6]),
            "stop_token_ids[1] is outside the vocabulary [0, 49152), got 1000000",
        ),
        (
            dict(max_tokens=10**9),
            "max_tokens 1000000000 leaves no room for a prompt: the model's context is 8192",
        ),
        (dict(max_tokens=8190), "more than the model's context of 8192 tokens (max_tokens at most"),
        (dict(logit_bias={49152: 1.0}), "sampling.logit_bias[49152] names a token outside the vocabulary"),
        (dict(stop=["a"] * 5), "stop has 5 strings; at most 4"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20], got 21"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": "["}}), "is not JSON"),
        (  # it would hold the grammar compiler (and every request behind it) for seconds
            dict(response_format={"type": "json_schema", "json_schema": {"schema": {"pattern": "c{12000}"}}}),
            "counted repeats ({n}, {n,m}) add up to 12000; at most 4096",
        ),
        (dict(repetition_penalty=1e-30), "sampling.repetition_penalty must be in [0.1, 10] (1 is off)"),
    ],
)
async def test_bad_sampling_fields_are_refused_and_change_nothing(smol_stack, fields, message):
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        options = GenerateOptions(text=NORMAL.text, max_tokens=fields.pop("max_tokens", 4), **fields)
        await expect(client.generate_all(options), grpc.StatusCode.INVALID_ARGUMENT, message)
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


async def test_a_temperature_too_small_to_divide_by_samples_greedy(smol_stack):
    """Dividing the logits by 1e-39 would overflow them and the draw would settle on token 0: below 1e-5 the
    planner samples greedy, as vLLM does."""
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        tiny = GenerateOptions(text=NORMAL.text, max_tokens=NORMAL.max_tokens, temperature=1e-39, seed=3)
        assert (await client.generate_all(tiny)).token_ids == expected


async def test_a_chat_of_more_messages_than_the_context_is_refused_before_templating(smol_stack):
    """Empty messages are a few bytes each but a token or more once templated: more than the context's tokens
    are refused by count, before the template runs, changing nothing."""
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        chat = [{"role": "user", "content": ""}] * 8193
        await expect(
            client.generate_all(GenerateOptions(chat=chat, max_tokens=1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat has 8193 messages: more than the model's context of 8192 tokens could hold",
        )
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


async def test_min_tokens_past_the_context_is_refused_where_max_tokens_is_the_rest(smol_stack):
    """max_tokens 0 means the rest of the context: a min_tokens beyond it (which would mask end-of-sequence and
    the stop ids for the whole answer) is refused once the prompt is tokenized, changing nothing."""
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        said = await expect(
            client.generate_all(GenerateOptions(text=NORMAL.text, max_tokens=0, min_tokens=10**9)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "min_tokens is 1000000000: more than the",
        )
        assert "output tokens the context leaves after the prompt" in said
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


async def test_a_request_without_max_tokens_gets_the_planners_default_where_one_is_set(
    smol_stack, monkeypatch
):
    """--default-max-tokens: what a request leaving max_tokens unset may write (and hold pages for), or its
    min_tokens if more (the arithmetic at the context's end: test_validation.py)."""
    monkeypatch.setattr(smol_stack.planner.intake, "default_max_tokens", 5)
    async with PlannerClient(smol_stack.addr) as client:
        for min_tokens, expected in ((0, 5), (7, 7)):
            options = GenerateOptions(
                token_ids=[504] * 8, max_tokens=0, ignore_eos=True, min_tokens=min_tokens
            )
            assert len((await client.generate_all(options)).token_ids) == expected


async def test_invalid_utf8_is_invalid_argument_naming_the_field(smol_stack):
    good = client_pb2.GenerateRequest(
        chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(role="user", content="hello there")]),
        max_tokens=3,
    ).SerializeToString()
    text = client_pb2.GenerateRequest(text="abcd", max_tokens=3).SerializeToString()
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        await expect(
            raw_generate(smol_stack.addr, good.replace(b"there", b"th\xfere")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.messages[0].content is not valid UTF-8 (byte 0xfe at offset 8)",
        )
        await expect(
            raw_generate(smol_stack.addr, text.replace(b"abcd", b"ab\xc3(")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "text is not valid UTF-8",
        )
        assert len(await raw_generate(smol_stack.addr, good)) >= 1  # the same bytes, valid, still serve
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


async def _stream_gaps(client: PlannerClient, started: asyncio.Event) -> list[float]:
    """Seconds between the messages of a long stream."""
    gaps, last = [], None
    async for _ in client.generate(
        GenerateOptions(text="Count to one thousand:", max_tokens=120, ignore_eos=True)
    ):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        started.set()
    return gaps


async def test_huge_prompts_are_refused_while_another_stream_keeps_going(smol_stack):
    """5 MB of text is refused before tokenizing, at once; 300 kB (under the bound) is tokenized off the event
    loop and refused for its token count. The other stream never stalls for 0.5 s meanwhile."""
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        started = asyncio.Event()
        stream = asyncio.create_task(_stream_gaps(client, started))
        await started.wait()
        began = time.perf_counter()
        await expect(
            client.generate_all(GenerateOptions(text="a" * (5 << 20), max_tokens=4)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "text is 5242880 bytes: more than the model's context of 8192 tokens could hold",
        )
        refused_s = time.perf_counter() - began
        await expect(
            client.generate_all(GenerateOptions(text="hello world " * 25_000, max_tokens=4)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tokens; the model's context is 8192",
        )
        gaps = await stream
        assert refused_s < 1.0
        assert max(gaps) < 0.5, f"a stream stalled for {max(gaps):.2f} s"
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


async def test_concurrent_duplicate_request_ids_with_a_conversation(smol_stack):
    """Issue 14 case 9: four at once with one request id and one conversation: one runs, three are refused."""
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        _, free_slots, _, _ = await state(smol_stack, client)
        options = GenerateOptions(
            text=NORMAL.text, max_tokens=6, request_id="same", conversation_id="dup-conv"
        )
        results = await asyncio.gather(
            *(client.generate_all(options) for _ in range(4)), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert len(served) == 1 and served[0].token_ids == expected
        assert len(refused) == 3
        for error in refused:
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS
            assert error.details() == "request id 'same' is already running"
        again = await client.generate_all(GenerateOptions(text="Hi", max_tokens=2, request_id="same"))
        assert again.finish_reason == "length"  # the id is free once its request ended
        _, slots_after, running, waiting = await state(smol_stack, client)
        assert (slots_after, running, waiting) == (free_slots, 0, 0)
        assert await normal_tokens(client) == expected


async def test_a_small_request_passes_requests_waiting_for_pages(smol_stack):
    """Issue 14 case 8: two requests each reserving most of the pool; the second waits for pages, and a
    4-token request behind it runs at once instead of waiting behind it."""
    async with PlannerClient(smol_stack.addr) as client:
        # The KV pressure below drops idle conversations, and those of earlier tests may share pages, which
        # state() counts once per conversation: begin with none.
        for conversation in await client.conversations():
            await client.delete_conversation(conversation.conversation_id)
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        big = GenerateOptions(text="Tell me a long story.", max_tokens=8000, ignore_eos=True)
        first = client.generate(big)
        await first.__anext__()  # running: it holds ~500 of the 639 pages
        second = asyncio.create_task(client.generate_all(big))
        while (await client.server_info()).waiting < 1:
            await asyncio.sleep(0.01)
        began = time.perf_counter()
        small = await client.generate_all(GenerateOptions(token_ids=[504, 3458, 314, 4649], max_tokens=4))
        waited_s = time.perf_counter() - began
        assert small.finish_reason in ("length", "stop") and waited_s < 10
        assert (await client.server_info()).waiting == 1  # the big one still waits
        second.cancel()
        await first.aclose()
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected


def _fuzzed(rng: random.Random) -> bytes:
    """A sound request with each field replaced, one time in eight, by an odd value."""
    floats = [-1.0, math.nan, math.inf, -math.inf, 1e30, 1e-30, 0.0, 2.0]
    ints = [0, -1, -(2**31), 2**31 - 1, 49151, 49152, 8191, 8192]

    def odd(good, values):
        return rng.choice(values) if rng.random() < 0.125 else good

    request = client_pb2.GenerateRequest(
        sampling=client_pb2.SamplingParams(
            temperature=odd(rng.choice([0.0, 0.8]), floats),
            top_k=odd(rng.choice([0, 40]), ints),
            seed=rng.randrange(2**64),
        ),
        # 0 is not odd: it asks for the rest of the context (thousands of tokens on this CPU)
        max_tokens=odd(rng.randrange(1, 4), [v for v in ints if v != 0]),
        stop_token_ids=odd([], [rng.sample(ints, 2)]),
        ignore_eos=rng.random() < 0.5,
        request_id=odd("", ["fuzz", "x" * 300]),
    )
    if rng.random() < 0.5:
        request.sampling.top_p = odd(0.9, floats)
    kind = rng.randrange(4)
    if kind == 0:
        request.text = odd("Hello there", ["", "é" * 50, "\x00\x01"])
    elif kind == 1:
        request.chat.messages.add(role=odd("user", ["", "system"]), content=odd("hi", ["", "\x00"]))
    elif kind == 2:
        request.token_ids = odd(
            pack_i32([504, 3458]), [b"", b"\x01\x02\x03", pack_i32([49152]), pack_i32([-1])]
        )
    data = request.SerializeToString()
    if kind == 3 or rng.random() < 0.05:  # a string that is not UTF-8
        data = (
            client_pb2.GenerateRequest(text="fuzzy", max_tokens=2)
            .SerializeToString()
            .replace(b"zz", b"\xff\xfe")
        )
    return data


async def test_fuzzed_requests_leave_the_service_healthy(smol_stack):
    """100 random requests, ten at a time: each is served or refused with INVALID_ARGUMENT or ALREADY_EXISTS,
    never another status; afterwards health says SERVING, nothing leaked and a normal request is unchanged."""
    rng = random.Random(14)
    async with PlannerClient(smol_stack.addr) as client:
        expected = await normal_tokens(client)
        before = await state(smol_stack, client)
        codes: dict[str, int] = {}
        for _ in range(10):
            batch = [raw_generate(smol_stack.addr, _fuzzed(rng)) for _ in range(10)]
            for result in await asyncio.gather(*batch, return_exceptions=True):
                code = result.code().name if isinstance(result, grpc.aio.AioRpcError) else "OK"
                assert code in ("OK", "INVALID_ARGUMENT", "ALREADY_EXISTS"), result
                codes[code] = codes.get(code, 0) + 1
        assert codes.get("OK", 0) >= 20 and codes.get("INVALID_ARGUMENT", 0) >= 20, codes
        assert await state(smol_stack, client) == before
        assert await normal_tokens(client) == expected
        async with grpc.aio.insecure_channel(smol_stack.addr) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert list(unpack_i32(pack_i32(expected))) == expected
