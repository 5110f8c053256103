"""Tools in a request: the tools and the history's calls and answers checked where the planner reads them for the
chat template, and an OpenAI body's tools, tool_choice and tool messages made the planner's request (a forced
call held to a JSON Schema), what it cannot take refused naming the field."""

from __future__ import annotations

import json

import pytest

from gateway_svc.openai_schema import ChatCompletionBody
from gateway_svc.translate import BadField, UnsupportedField, chat_choices
from planner_svc.chat_tools import MAX_TOOLS_DEPTH, parse_tool_calls, parse_tools
from planner_svc.validation import InvalidRequest
from tests.test_tool_calls import WEATHER

USER = {"role": "user", "content": "hi"}


# ---- the planner's side: what the chat template reads ----


def test_tools_and_tool_calls_are_checked_and_arguments_become_mappings():
    assert parse_tools("") is None
    deep: object = 0
    for _ in range(MAX_TOOLS_DEPTH):
        deep = [deep]
    assert parse_tools(json.dumps([WEATHER])) == [WEATHER]
    for text, says in (
        ("[]", "non-empty JSON list"),
        ('[{"type": "function"}]', r"chat.tools\[0\] must be"),
        ('[{"type": "code", "function": {"name": "f"}}]', r"chat.tools\[0\] must be"),
        (json.dumps([{**WEATHER, "x": deep}]), "nests deeper"),
        ("[", "is not JSON"),
    ):
        with pytest.raises(InvalidRequest, match=says):
            parse_tools(text)
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "not json"}},
    ]
    parsed = parse_tool_calls(3, json.dumps(calls))
    assert parsed[0]["function"]["arguments"] == {"city": "Paris"}  # templates walk or tojson a mapping
    assert parsed[1]["function"]["arguments"] == "not json" and parsed[0]["id"] == "a"
    with pytest.raises(InvalidRequest, match=r"chat.messages\[3\].tool_calls\[0\] must be"):
        parse_tool_calls(3, '[{"type": "function", "function": {}}]')


# ---- the gateway's side: the request ----


def test_tools_their_calls_and_answers_go_to_the_planner_and_function_call_is_refused():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "content": "42", "tool_call_id": "1"})
    [choice] = chat_choices(_chat(messages=messages, tools=[tool]), None, "r")
    assert choice.options.chat == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert (
        choice.options.tools == [tool]
        and choice.tool_spec is not None
        and set(choice.tool_spec.parameters) == {"f"}
    )
    [offered] = chat_choices(
        _chat(tools=[tool], tool_choice="none"), None, "r"
    )  # in the prompt, never parsed
    assert offered.options.tools == [tool] and offered.tool_spec is None
    [named] = chat_choices(
        _chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}), None, "r"
    )
    assert named.options.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "f", "schema": {"type": "object"}},
    }
    assert named.tool_spec is not None and (named.tool_spec.mode, named.tool_spec.name) == ("named", "f")
    with pytest.raises(BadField, match="response_format and a forced tool call"):
        chat_choices(
            _chat(tools=[tool], tool_choice="required", response_format={"type": "json_object"}), None, "r"
        )
    for other in (
        {"type": "function", "function": {"name": "g"}},
        {"type": "function", "function": {"name": ["f"]}},
        "any",
    ):
        with pytest.raises(BadField, match="naming one of the tools"):
            chat_choices(_chat(tools=[tool], tool_choice=other), None, "r")
    with pytest.raises(BadField, match="give tools"):
        chat_choices(_chat(tool_choice={"type": "function", "function": {"name": "f"}}), None, "r")
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(UnsupportedField) as refused:
        chat_choices(_chat(messages=[USER, legacy]), None, "r")
    assert refused.value.param == "messages.1.function_call"


def _chat(**fields):
    return ChatCompletionBody.model_validate({"model": "m", "messages": [USER], **fields})


def test_malformed_or_twice_named_tools_and_parallel_calls_off_are_refused_naming_the_field():
    for tools in ([{"type": "function"}], [WEATHER, WEATHER], [{"type": "code", "function": {"name": "f"}}]):
        with pytest.raises(BadField, match="each of tools must be") as refused:
            chat_choices(_chat(tools=tools), None, "r")
        assert refused.value.param == "tools"
    with pytest.raises(UnsupportedField, match="parallel_tool_calls false") as off:
        chat_choices(_chat(tools=[WEATHER], parallel_tool_calls=False), None, "r")
    assert off.value.param == "parallel_tool_calls"
    chat_choices(_chat(tools=[WEATHER], parallel_tool_calls=True), None, "r")
