"""Tools (OpenAI's function calling) in the answer: the calls found in its text (<tool_call> JSON or XML) or read
from a forced call's JSON, whole and streamed, the two agreeing; and over the real stack (SmolLM2 on the CPU with
tests/chat_templates.py's template, through OpenAI's client) a few-shot history after which the model calls the
tool (in tags, or as Llama 3's bare JSON): the same call whole and streamed, raw text with tool_choice none."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gateway_svc.tool_calls import ToolCallStream, ToolSpec, parse_calls
from planner_svc.tokenizer import chat_ids
from protos import client_pb2
from tests.choice_replies import both

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SPEC = ToolSpec.of([WEATHER])

# ---- the gateway's side: the calls in the answer ----


def _arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_in_json_and_in_xml_are_found_after_the_content():
    content, calls = parse_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
        SPEC,
    )
    assert content == "Let me look.\n"
    assert _arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome", "days": 2}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # Qwen3.5's form: the schema types the values (a string stays one, even when it spells a number)
    xml = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert _arguments(parse_calls(xml, SPEC)[1]) == [("get_weather", {"city": "1984", "days": 3})]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not a tool of the request
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
        '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # not closed: cut by max_tokens
        "<tool_call><function=get_weather><parameter=city>San Fr",  # the same in XML
    ],
)
def test_text_without_a_whole_call_of_a_given_tool_makes_none(text):
    assert parse_calls(text, SPEC) is None


def test_several_calls_in_a_block_code_in_an_argument_and_a_thought_that_quotes_the_tags():
    xml = "<tool_call><function=get_weather><parameter=city>a</parameter></function>\n"
    xml += "<function=get_weather><parameter=city>b</parameter></function></tool_call>"
    assert _arguments(parse_calls(xml, SPEC)[1]) == [
        ("get_weather", {"city": "a"}),
        ("get_weather", {"city": "b"}),
    ]
    code = {"city": 'print("</tool_call>")'}
    call = f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': code})}</tool_call> Done."
    assert _arguments(parse_calls(call, SPEC)[1]) == [("get_weather", code)]  # the text after it is dropped
    thought = "<think>I answer with <tool_call> tags.</think>\n"
    content, calls = parse_calls(thought + call, SPEC)
    assert content == thought and _arguments(calls) == [("get_weather", code)]
    nullable = ToolSpec(
        {"f": {"properties": {"n": {"type": ["string", "null"]}, "m": {"type": ["integer", "null"]}}}}
    )
    values = "<tool_call><function=f><parameter=n>42</parameter><parameter=m>null</parameter></function></tool_call>"
    assert _arguments(parse_calls(values, nullable)[1]) == [("f", {"n": "42", "m": None})]


def test_a_stream_sends_the_content_and_holds_from_where_a_call_may_begin():
    stream = ToolCallStream(SPEC)
    pieces = [
        "Let me",
        " look. <to",
        'ol_call>\n{"name": "get_weather",',
        ' "arguments": {"city": "Oslo"}}',
        "</tool_call>",
    ]
    assert [stream.feed(p) for p in pieces] == ["Let me", " look. ", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and _arguments(calls) == [("get_weather", {"city": "Oslo"})]
    plain = ToolCallStream(SPEC)
    assert [plain.feed(p) for p in ["a <to", "ol box", " <"]] == ["a ", "<tool box", " "]
    assert plain.finish() == ("<", [])  # the end: what was held is content
    broken = ToolCallStream(SPEC)
    assert broken.feed('<tool_call>{"name": "launch"}') == ""
    assert broken.finish() == ('<tool_call>{"name": "launch"}', [])  # no call: the text, unchanged


def test_a_forced_call_is_held_to_a_schema_and_read_from_it():
    named = replace(SPEC, mode="named", name="get_weather")
    assert named.schema() == WEATHER["function"]["parameters"]
    assert _arguments(named.find(' {"city": "Oslo"}')[1]) == [("get_weather", {"city": "Oslo"})]
    required = replace(SPEC, mode="required")
    [one_of] = required.schema()["items"]["anyOf"]
    assert one_of["properties"] == {
        "name": {"const": "get_weather"},
        "parameters": WEATHER["function"]["parameters"],
    }
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": {"city": "Bergen"}}]'
    assert _arguments(required.find(answer)[1]) == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Bergen"}),
    ]
    assert required.find('[{"name": "get_weather", "param') is None  # cut by max_tokens: the text is content
    stream = ToolCallStream(named)
    assert stream.feed('{"city"') == stream.feed(': "Oslo"}') == ""  # a forced call's text is never content
    assert _arguments(stream.finish()[1]) == [("get_weather", {"city": "Oslo"})]


OSLO = ['{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "</tool_call>"]


LLAMA_OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize(
    "text, content, cities",
    [
        (LLAMA_OSLO, "", ["Oslo"]),
        (f" \n{LLAMA_OSLO}\n", " \n", ["Oslo"]),
        (f"{LLAMA_OSLO}; {LLAMA_OSLO.replace('Oslo', 'Bergen')};", "", ["Oslo", "Bergen"]),
        (f"<think>Oslo?</think>\n\n{LLAMA_OSLO}", "<think>Oslo?</think>\n\n", ["Oslo"]),
        (f"Sure: {LLAMA_OSLO}", None, None),  # text before it: an answer that quotes JSON
        (f"{LLAMA_OSLO} Done.", None, None),
        (LLAMA_OSLO.replace("get_weather", "get_time"), None, None),  # no such tool
        (LLAMA_OSLO[:-3], None, None),  # cut by max_tokens
        ('{"city": "Oslo"}', None, None),  # JSON, and no call
        ('{"name": "get_weather", "description": "x"}', None, None),  # no parameters: not a call
        (LLAMA_OSLO + LLAMA_OSLO, None, None),  # several without `;` between them
    ],
)
def test_llama_3s_bare_json_calls_are_found_where_they_are_the_whole_answer(text, content, cities):
    found = parse_calls(text, SPEC)
    if cities is None:
        assert found is None
    else:
        assert found[0] == content and _arguments(found[1]) == [("get_weather", {"city": c}) for c in cities]


@pytest.mark.parametrize(
    "pieces, content",
    [
        (["Sure.", "\n<tool", "_call>", *OSLO], "Sure.\n"),
        (["\n", " \n<tool_call>", *OSLO], None),  # white space alone before the call: no content
    ],
)
def test_a_streamed_call_and_the_whole_answer_agree(pieces, content):
    answer, streamed, _, calls, finish = both(pieces, client_pb2.FINISH_REASON_STOP, spec=SPEC)
    assert (answer["message"]["content"], streamed or None) == (content, content)
    assert (
        _arguments(calls)
        == _arguments(answer["message"]["tool_calls"])
        == [("get_weather", {"city": "Oslo"})]
    )
    assert finish == answer["finish_reason"] == "tool_calls"


def test_arguments_nested_too_deep_to_write_back_are_no_call():
    """Read just under the recursion limit, they failed to be written back as JSON text: a 500."""
    for depth in range(600, 1000):  # the depth that reads and does not write depends on the stack's own
        nested = "[" * depth + "]" * depth
        found = parse_calls(f'{{"name": "get_weather", "parameters": {{"a": {nested}}}}}', SPEC)
        assert found is None or found[1][0]["function"]["name"] == "get_weather"


def test_a_streamed_bare_json_answer_is_held_until_it_is_read_whole():
    pieces = ["\n", LLAMA_OSLO[:12], LLAMA_OSLO[12:]]
    answer, streamed, _, calls, finish = both(pieces, client_pb2.FINISH_REASON_STOP, spec=SPEC)
    assert answer["message"]["content"] is None and streamed == ""
    assert (
        _arguments(calls)
        == _arguments(answer["message"]["tool_calls"])
        == [("get_weather", {"city": "Oslo"})]
    )
    assert finish == answer["finish_reason"] == "tool_calls"
    after_thought = ["<think>Oslo?</th", "ink>\n", LLAMA_OSLO[:12], LLAMA_OSLO[12:]]  # thoughts left as text
    answer, streamed, _, calls, finish = both(after_thought, client_pb2.FINISH_REASON_STOP, spec=SPEC)
    assert answer["message"]["content"] == streamed == "<think>Oslo?</think>\n"
    assert (
        _arguments(calls)
        == _arguments(answer["message"]["tool_calls"])
        == [("get_weather", {"city": "Oslo"})]
    )
    assert finish == answer["finish_reason"] == "tool_calls"
    pieces = ['{"city"', ': "Oslo"}']  # JSON that is no call: content, at the end
    answer, streamed, _, calls, finish = both(pieces, client_pb2.FINISH_REASON_STOP, spec=SPEC)
    assert answer["message"]["content"] == streamed == '{"city": "Oslo"}' and calls == []
    assert finish == answer["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_or_a_stop_string_keeps_the_planners_reason():
    pieces = ["Sure.", "\n<tool_call>", *OSLO[:2]]
    answer, streamed, _, calls, finish = both(pieces, client_pb2.FINISH_REASON_LENGTH, spec=SPEC)
    assert (
        answer["message"]["content"] == streamed == "".join(pieces) and "tool_calls" not in answer["message"]
    )
    assert calls == [] and finish == answer["finish_reason"] == "length"
    named = replace(SPEC, mode="named", name="get_weather")
    for reason, stop_string, said in (
        (client_pb2.FINISH_REASON_LENGTH, "", "length"),
        (client_pb2.FINISH_REASON_STOP, "lo", "stop"),
    ):
        answer, streamed, _, calls, finish = both(['{"city": ', '"Os'], reason, stop_string, spec=named)
        assert finish == answer["finish_reason"] == said and streamed == ""
        assert [c["function"]["arguments"] for c in calls] == ['{"city": "Os']  # as far as it was written
        assert answer["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'


def test_a_required_call_of_tools_with_definitions_refers_to_them_at_the_root():
    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    moving = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/City"}},
                "$defs": {"City": city},
            },
        },
    }
    schema = replace(ToolSpec.of([WEATHER, moving]), mode="required").schema()
    assert schema["$defs"] == {"tool1_City": city}
    [weather, move] = schema["items"]["anyOf"]
    assert move["properties"]["parameters"] == {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/tool1_City"}},
    }
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    odd = ToolSpec({"f": {"properties": {"x": {"type": {"not": "a name"}}, "y": {"type": [["string"]]}}}})
    xml = "<tool_call><function=f><parameter=x>1</parameter><parameter=y>2</parameter></function></tool_call>"
    assert _arguments(parse_calls(xml, odd)[1]) == [("f", {"x": "1", "y": "2"})]  # an odd type: the text


# ---- over the stack ----


def _few_shot() -> list[dict]:
    """Three questions, each answered by a call, its result and a sentence; then a fourth question."""
    messages: list[dict] = []
    for i, city in enumerate(["Paris", "Berlin", "Rome"]):
        arguments = json.dumps({"city": city})
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": f"call_{i}"},
            {"role": "assistant", "content": f"It is sunny in {city}."},
        ]
    return [*messages, {"role": "user", "content": "What is the weather in Madrid?"}]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_model_calls_the_tool_whole_and_streamed(templated):
    messages = _few_shot()
    fields = dict(model=templated.model, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0)
    whole = await templated.client.chat.completions.create(**fields)
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Madrid"})
    # the prompt: the template's rendering of the tools, and of each call with its arguments as a mapping
    for message in messages:
        for past in message.get("tool_calls") or ():
            past["function"]["arguments"] = json.loads(past["function"]["arguments"])
    tokenizer = templated.stack.planner.tokenizer
    rendered = chat_ids(
        tokenizer, [{**m, "content": m["content"] or ""} for m in messages], {"tools": [WEATHER]}
    )
    assert whole.usage.prompt_tokens == len(rendered)

    stream = await templated.client.chat.completions.create(**fields, stream=True)
    chunks = [chunk async for chunk in stream]
    assert not any(c.choices[0].delta.content for c in chunks)  # the call's text is never content
    [streamed] = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert (streamed.index, streamed.type, streamed.function.name) == (0, "function", "get_weather")
    assert json.loads(streamed.function.arguments) == {"city": "Madrid"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.asyncio(loop_scope="session")
async def test_bare_json_calls_are_found_whole_and_streamed(templated):
    """Llama 3's form: a history whose answers were calls as JSON alone leads SmolLM2 to answer so."""
    messages: list[dict] = []
    for city in ["Paris", "Berlin", "Rome"]:
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": LLAMA_OSLO.replace("Oslo", city)},
            {"role": "user", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."},
        ]
    messages.append({"role": "user", "content": "What is the weather in Madrid?"})
    fields = dict(model=templated.model, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0)
    [whole] = (await templated.client.chat.completions.create(**fields)).choices
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert _arguments([c.model_dump() for c in whole.message.tool_calls]) == [
        ("get_weather", {"city": "Madrid"})
    ]
    chunks = [chunk async for chunk in await templated.client.chat.completions.create(**fields, stream=True)]
    assert not any(c.choices[0].delta.content for c in chunks)
    calls = [d.model_dump() for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert _arguments(calls) == [("get_weather", {"city": "Madrid"})]


@pytest.mark.asyncio(loop_scope="session")
async def test_with_tool_choice_none_the_answer_is_text(templated):
    reply = await templated.client.chat.completions.create(
        model=templated.model,
        messages=_few_shot(),
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    [choice] = reply.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")  # the model's text, as it wrote it


@pytest.mark.asyncio(loop_scope="session")
async def test_a_forced_call_is_made_named_or_required(templated):
    fields = dict(model=templated.model, tools=[WEATHER], max_tokens=60, temperature=0)
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    named = await templated.client.chat.completions.create(
        messages=_few_shot(), tool_choice=named_choice, **fields
    )
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    stream = await templated.client.chat.completions.create(
        messages=_few_shot(), tool_choice=named_choice, stream=True, **fields
    )
    chunks = [chunk async for chunk in stream]
    assert not any(c.choices[0].delta.content for c in chunks)
    [streamed] = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert streamed.function.arguments == call.function.arguments  # greedy: the same call

    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    required = await templated.client.chat.completions.create(
        messages=question, tool_choice="required", **fields
    )
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert all(isinstance(json.loads(c.function.arguments)["city"], str) for c in calls)
