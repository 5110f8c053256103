"""The gateway's pure parts: OpenAI bodies to GenerateOptions, gRPC statuses to HTTP errors, and the events
of a stream that fails after it began."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2 as httpx
import pytest

from gateway_svc.app import _events, _first_of_each
from gateway_svc.http_errors import HTTP_STATUS, ApiError
from gateway_svc.openai_replies import ChoiceState, ChunkWriter
from gateway_svc.openai_schema import ChatCompletionBody, CompletionBody
from gateway_svc.relay import arrived_together
from gateway_svc.translate import BadField, UnsupportedField, chat_choices, completion_choices
from protos import client_pb2
from protos.wire import pack_i32

USER = {"role": "user", "content": "hi"}


def chat(**fields):
    return ChatCompletionBody.model_validate({"model": "m", "messages": [USER], **fields})


def test_a_chat_body_maps_onto_the_planners_request():
    body = chat(
        messages=[
            {
                "role": "system",
                "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            },
            USER,
        ],
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop_token_ids=[5],
        conversation_id="c",
        shared_prefix={"message": 0, "chars": 3},
        chat_template_kwargs={"enable_thinking": False},
    )
    [choice] = chat_choices(body, None, "chatcmpl-x")
    o = choice.options
    assert o.chat == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed) == (7, 0.5, 0.9, 3, 11)
    assert (tuple(o.stop_token_ids), o.conversation_id, o.request_id, o.n) == ((5,), "c", "chatcmpl-x-0", 1)
    assert o.shared_prefix == {"message": 0, "chars": 3}
    assert o.chat_template_kwargs == {"enable_thinking": False}


def test_defaults_are_openais():
    [choice] = chat_choices(chat(), None, "r")
    assert (choice.options.max_tokens, choice.options.temperature) == (0, 1.0)  # 0: up to the context's end
    [text] = completion_choices(CompletionBody(model="m", prompt="x"), None, "r")
    assert text.options.max_tokens == 16 and text.options.text == "x"


def test_each_prompt_is_one_request_for_its_n_choices_numbered_as_openai_does():
    body = CompletionBody(model="m", prompt=[[1, 2], [3]], n=2, seed=7)
    choices = completion_choices(body, None, "r")
    assert [(c.index, c.prompt, c.options.n, c.options.seed) for c in choices] == [(0, 0, 2, 7), (2, 1, 2, 7)]
    assert [list(c.indices()) for c in choices] == [[0, 1], [2, 3]]
    assert [tuple(c.options.token_ids or ()) for c in choices] == [(1, 2), (3,)]
    assert [c.options.request_id for c in choices] == ["r-0", "r-1"]
    unseeded = completion_choices(CompletionBody(model="m", prompt=["x", "y"], n=2), None, "r")
    assert [c.options.seed for c in unseeded] == [None, None]  # the planner draws each request's seed


def test_the_conversation_comes_from_the_body_or_the_header():
    assert chat_choices(chat(), "from-header", "r")[0].options.conversation_id == "from-header"
    assert chat_choices(chat(conversation_id="a"), "a", "r")[0].options.conversation_id == "a"
    with pytest.raises(BadField, match="differ"):
        chat_choices(chat(conversation_id="a"), "b", "r")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"best_of": 2}, "best_of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    with pytest.raises(UnsupportedField) as refused:
        chat_choices(chat(**fields), None, "r")
    assert refused.value.param == param


# vLLM's extensions besides those the gateway honours, each with a value that would change the answer
VLLM_REFUSED = [
    ("guided_choice", ["yes", "no"]),
    ("guided_regex", "[0-9]+"),
    ("guided_json", {"type": "object"}),
    ("guided_grammar", 'root ::= "a"'),
    ("structured_outputs", {"choice": ["yes", "no"]}),
    ("allowed_token_ids", [11, 12]),
    ("bad_words", ["Berlin"]),
    ("use_beam_search", True),
    ("length_penalty", 2.0),
    ("prompt_logprobs", 2),
    ("prompt_logprobs", 0),  # the prompt's own logprobs
    ("truncate_prompt_tokens", 3),
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("add_generation_prompt", False),
    ("echo", True),  # vLLM's chat takes echo too
]
VLLM_HARMLESS = {
    "guided_json": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "bad_words": [],
    "skip_special_tokens": True,
    "prompt_logprobs": None,
    "add_generation_prompt": True,
    "echo": False,
}


@pytest.mark.parametrize("field, value", VLLM_REFUSED)
def test_vllms_extensions_the_gateway_does_not_honour_are_refused_by_name(field, value):
    """Not accepted among the unknown fields and served as if absent (a 200 with unconstrained text)."""
    for make, body in (
        (chat_choices, chat(**{field: value})),
        (completion_choices, CompletionBody.model_validate({"model": "m", "prompt": "x", field: value})),
    ):
        with pytest.raises(UnsupportedField) as refused:
            make(body, None, "r")
        assert refused.value.param == field and field in str(refused.value)


def test_vllms_extensions_set_to_what_asks_for_nothing_pass():
    chat_choices(chat(**VLLM_HARMLESS), None, "r")
    completion_choices(
        CompletionBody.model_validate({"model": "m", "prompt": "x", **VLLM_HARMLESS}), None, "r"
    )
    for field, value in (("use_beam_search", 0), ("length_penalty", True)):  # a number is no boolean
        with pytest.raises(UnsupportedField, match=field):
            chat_choices(chat(**{field: value}), None, "r")


def test_values_that_ask_for_nothing_pass():
    chat_choices(
        chat(
            logprobs=False,
            response_format={"type": "text"},
            tool_choice="none",
            function_call="none",
            stop=[],
            tools=[],
        ),
        None,
        "r",
    )
    completion_choices(CompletionBody(model="m", prompt="x", echo=None), None, "r")


def test_null_is_the_default_for_openais_nullable_fields():
    [choice] = chat_choices(chat(n=None, stream=None, ignore_eos=None, return_token_ids=None), None, "r")
    assert (choice.options.n, choice.options.ignore_eos) == (1, False)
    [text] = completion_choices(CompletionBody(model="m", prompt="x", n=None, echo=None), None, "r")
    assert text.options.n == 1


def test_top_k_minus_one_is_off_as_vllms():
    assert chat_choices(chat(top_k=-1), None, "r")[0].options.top_k == 0


def test_values_past_the_wire_types_are_refused_by_field():
    import pydantic

    for field, value in (
        ("max_tokens", 2**31),
        ("max_completion_tokens", 2**31),
        ("seed", 2**64),
        ("stop_token_ids", [2**31]),
        ("shared_prefix", {"tokens": 2**31}),
    ):
        with pytest.raises(pydantic.ValidationError, match=field):
            chat(**{field: value})
    with pytest.raises(BadField, match="logit_bias keys"):
        chat_choices(chat(logit_bias={str(2**31): 1.0}), None, "r")


def test_a_completion_takes_response_format():
    schema = {"type": "json_object"}
    [text] = completion_choices(CompletionBody(model="m", prompt="x", response_format=schema), None, "r")
    assert text.options.response_format == schema


def test_grpc_statuses_map_to_http_statuses():
    assert [
        HTTP_STATUS[getattr(grpc.StatusCode, name)] for name in ("INVALID_ARGUMENT", "UNAUTHENTICATED")
    ] == [
        400,
        401,
    ]
    assert HTTP_STATUS[grpc.StatusCode.PERMISSION_DENIED] == 403
    assert HTTP_STATUS[grpc.StatusCode.NOT_FOUND] == 404
    assert HTTP_STATUS[grpc.StatusCode.RESOURCE_EXHAUSTED] == 429
    assert HTTP_STATUS[grpc.StatusCode.UNAVAILABLE] == 503
    assert HTTP_STATUS.get(grpc.StatusCode.INTERNAL, 500) == 500
    error = ApiError(429, "the queue is full")
    assert error.body() == {
        "error": {"message": "the queue is full", "type": "rate_limit_error", "param": None, "code": None}
    }
    assert error.response().headers["retry-after"] == "1"


async def test_an_error_after_the_stream_began_is_an_event_then_done():
    async def cut():
        yield 0, client_pb2.GenerateResponse(request_id="r-0", token_ids=pack_i32([7]), text="Hi")
        raise ApiError(503, "executor lost; the request was cut after 2 tokens")

    stream = cut()
    first = await anext(stream)
    writer = ChunkWriter("chat", "chatcmpl-r", 1, "m", "", False, False, False)
    events = [e async for e in _events(writer, stream, [first], {0: ChoiceState(0, 0, streamed=True)})]
    assert [e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events] == [True] * 3
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert json.loads(events[1][6:])["error"]["type"] == "service_unavailable_error"
    assert events[2] == b"data: [DONE]\n\n"


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("token_ids", [True, False])
def test_a_plain_chunk_written_directly_is_what_encoding_its_dict_writes(kind, token_ids):
    writer = ChunkWriter(kind, "cmpl-r", 1, "m", "", token_ids, True, False)
    state = ChoiceState(0, 0, streamed=True)
    writer.chunk(state, client_pb2.GenerateResponse(text="a"), [])  # the first chunk (role) is out
    for text, ids in [(' h\u00e9"\\\n\u2028\U0001f600', [5, 6]), ("", [7]), ("x", [])]:
        event = writer.chunk(state, client_pb2.GenerateResponse(text=text), ids)
        if not text and not token_ids:
            assert event is None
            continue
        assert event is not None
        choice: dict = {"index": 0, "finish_reason": None, "logprobs": None}
        if kind == "chat":
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        if token_ids:
            choice["token_ids"] = ids
        expected = {"id": "cmpl-r", "created": 1, "model": "m", "choices": [choice], "usage": None}
        assert json.loads(event[6:]) == {**expected, "object": json.loads(event[6:])["object"]}
        assert (
            event
            == writer._head
            + json.dumps(choice, separators=(",", ":"), ensure_ascii=False).encode()
            + writer._tail
        )


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_plain_chunk_of_thought_written_directly_is_what_encoding_its_dict_writes(field):
    writer = ChunkWriter("chat", "chatcmpl-r", 1, "m", "", False, False, False)
    state = ChoiceState(0, 0, streamed=True, reasoning_field=field)
    first = client_pb2.GenerateResponse(text="a", begins_in_thought=True)
    writer.chunk(state, first, state.add(first))  # the first chunk (role) is out
    for text, delta in [
        (' h\u00e9"\n', {field: ' h\u00e9"\n'}),
        ("b</think>\n", {field: "b", "content": "\n"}),
    ]:
        response = client_pb2.GenerateResponse(text=text)
        event = writer.chunk(state, response, state.add(response))
        choice = {"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}
        assert event == writer._head + json.dumps(
            choice, separators=(",", ":"), ensure_ascii=False
        ).encode() + (writer._tail)


async def test_responses_that_arrived_together_go_out_as_one_group():
    """arrived_together: what had arrived while the previous group was taken comes as one list; an error comes
    after what preceded it; closing the groups early closes the stream."""
    released = asyncio.Event()
    closed = []

    async def stream():
        try:
            yield 2
            yield 3
            await released.wait()
            yield 4
            raise ApiError(503, "gone")
        finally:
            closed.append(True)

    groups = arrived_together(stream(), [0, 1])  # what the gateway took before: every prompt's first
    assert await anext(groups) == [0, 1]
    await asyncio.sleep(0)  # the pump takes 2 and 3 meanwhile
    await asyncio.sleep(0)
    assert await anext(groups) == [2, 3]
    released.set()
    assert await anext(groups) == [4]
    with pytest.raises(ApiError):
        await anext(groups)
    assert closed == [True]

    async def endless():
        try:
            while True:
                yield 0
                await asyncio.sleep(0)
        finally:
            closed.append(False)

    running = endless()
    groups = arrived_together(running, [await anext(running)])  # as the gateway: the first taken before
    await anext(groups)
    await groups.aclose()
    assert closed == [True, False]


def test_text_offsets_are_the_same_streamed_or_whole_across_split_characters():
    """A completion's text_offset counts the characters the tokens' bytes made: tokens inside one emoji
    start where it starts, whether the tokens come one response at a time or in one whole answer."""
    from gateway_svc.openai_replies import logprobs

    parts = [b"\xf0\x9f", b"\x98\x83", b"a", b"\xf0\x9f\x98", b"\x8e", b"!"]
    entries = [
        client_pb2.TokenLogprobs(chosen=client_pb2.TokenLogprob(token_id=i, token="?", token_bytes=part))
        for i, part in enumerate(parts)
    ]
    whole = logprobs("text", entries, ChoiceState(0, 0))["text_offset"]
    streamed_state = ChoiceState(0, 0)
    streamed = [logprobs("text", [entry], streamed_state)["text_offset"][0] for entry in entries]
    assert whole == streamed == [0, 0, 1, 2, 2, 3]


async def test_a_streamed_answer_waits_for_every_prompts_first_response():
    """Before its headers, the responses until each prompt has answered once, in arrival order; the rest stays
    in the stream. A stream that ends first gives what came."""
    states = {
        0: ChoiceState(0, 0),
        1: ChoiceState(1, 0),
        2: ChoiceState(2, 1),
    }  # prompt 0's two choices, 1's one

    async def stream():
        for item in ((0, "a"), (1, "b"), (0, "c"), (2, "d"), (2, "e")):
            yield item

    arrived = stream()
    assert await _first_of_each(arrived, states, 2) == [(0, "a"), (1, "b"), (0, "c"), (2, "d")]
    assert await anext(arrived) == (2, "e")

    async def short():
        yield 0, "a"

    assert await _first_of_each(short(), states, 2) == [(0, "a")]


async def test_the_body_bound_refuses_a_declared_or_a_chunked_body_over_it():
    from fastapi import FastAPI

    from gateway_svc.body_limit import BodyLimit
    from gateway_svc.http_errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    app.add_middleware(BodyLimit, limit=16)
    big = b'{"a": "' + b"x" * 20 + b'"}'

    async def chunks():
        yield big[:10]
        yield big[10:]

    json_type = {"content-type": "application/json"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        fits = await client.post("/echo", json={"a": 1})
        declared = await client.post("/echo", content=big, headers=json_type)
        chunked = await client.post("/echo", content=chunks(), headers=json_type)
    assert (fits.status_code, fits.json()) == (200, {"a": 1})
    for refused in (declared, chunked):
        error = refused.json()["error"]
        assert (refused.status_code, error["code"]) == (413, "resource_exhausted"), error
        assert error["message"] == "the request body is over 16 bytes, the gateway's bound"
