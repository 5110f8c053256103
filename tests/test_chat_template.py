"""A chat template of the server's choosing (--chat-template) and requests' chat_template_kwargs (vLLM's
extension; Qwen3's enable_thinking): checked where they are parsed, and over the real stack (SmolLM2 on the
CPU) through OpenAI's client: the prompt the model reads is transformers' rendering of the template with the
request's variables, and a bad variable is a 400 that harms no later request."""

from __future__ import annotations

import json

import openai
import pytest

from planner_svc.client import GenerateOptions
from planner_svc.template_kwargs import MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_DEPTH, parse_template_kwargs
from planner_svc.tokenizer import TemplateRefused, chat_ids, planner_tokenizer, reserved_template_names
from planner_svc.validation import InvalidRequest
from tests.chat_templates import TOOLS_TEMPLATE

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
RESERVED = frozenset({"tokenize", "bos_token", "messages"})

# ---- parsing (pure) ----


def test_template_kwargs_are_a_json_object_of_new_identifiers():
    assert parse_template_kwargs("", RESERVED) == {}
    assert parse_template_kwargs('{"enable_thinking": false, "n": 3}', RESERVED) == {
        "enable_thinking": False,
        "n": 3,
    }
    too_many = json.dumps({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)})
    deep = '{"a": ' + "[" * 500 + "]" * 500 + "}"
    for text, says in (
        ("{", "is not JSON"),
        ("[1]", "must be a JSON object, got list"),
        ('{"a-b": 1}', "must be an identifier, got 'a-b'"),
        ('{"tokenize": false}', "'tokenize' is the template's own variable"),
        ('{"messages": []}', "'messages' is the template's own variable"),
        ('{"bos_token": "x"}', "'bos_token' is the template's own variable"),
        (too_many, f"at most {MAX_TEMPLATE_KWARGS} keys"),
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper than"),  # json refuses it
        (deep, f"nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH}"),  # transformers' copy would overflow
    ):
        with pytest.raises(InvalidRequest, match=says):
            parse_template_kwargs(text, RESERVED)
    depth = MAX_TEMPLATE_KWARGS_DEPTH - 1  # under the kwargs' own object
    assert parse_template_kwargs('{"a": ' + "[" * depth + "]" * depth + "}", RESERVED)


def test_the_reserved_names_are_apply_chat_templates_parameters_and_the_special_tokens():
    tokenizer = planner_tokenizer(None, None)
    reserved = reserved_template_names(tokenizer)
    assert {"tokenize", "return_dict", "add_generation_prompt", "tools", "chat_template"} <= reserved
    assert {"bos_token", "eos_token"} <= reserved
    assert {
        "self",
        "range",
        "cycler",
        "messages",
        "raise_exception",
    } <= reserved  # a `self` kwarg is a TypeError; `range` Jinja's function
    assert "enable_thinking" not in reserved


def test_a_server_template_replaces_the_tokenizers_own_and_reads_the_requests_variables():
    own = planner_tokenizer(None, None)
    served = planner_tokenizer(None, TOOLS_TEMPLATE)
    plain = chat_ids(served, QUESTION, {})
    assert plain != chat_ids(own, QUESTION, {})  # no default system turn
    assert (
        plain
        == own.apply_chat_template(QUESTION, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)[
            "input_ids"
        ]
    )
    thinking_off = chat_ids(served, QUESTION, {"enable_thinking": False})
    assert thinking_off[: len(plain)] == plain and len(thinking_off) > len(plain)
    with pytest.raises(ValueError, match="the chat template does not parse"):
        planner_tokenizer(None, "{% for message in messages %}")
    # a variable the template cannot use as it is (a TypeError inside it), and one it refuses: a 400 each
    counting = planner_tokenizer(None, "{{ messages[0]['content'] }}{{ repeat + 1 }}")
    assert chat_ids(counting, QUESTION, {"repeat": 1})
    for kwargs in ({"repeat": [1]}, {"repeat": "1"}):
        with pytest.raises(TemplateRefused, match="the chat template refused the messages"):
            chat_ids(counting, QUESTION, kwargs)
    refusing = planner_tokenizer(None, "{% if strict %}{{ raise_exception('no system turns') }}{% endif %}x")
    with pytest.raises(TemplateRefused, match="no system turns"):
        chat_ids(refusing, QUESTION, {"strict": True})


def test_a_template_that_refuses_the_system_turn_alone_leaves_a_turn_unmarked_not_refused():
    """The root and a shared prefix of messages are found by rendering the first messages alone, which a
    template may refuse (it asks for a user turn): the turn goes on without them, saying why for the pin."""
    from planner_svc.intake import Intake
    from protos import client_pb2

    template = (
        "{% if messages[-1]['role'] == 'system' %}{{ raise_exception('a chat ends with a user turn') }}{% endif %}"
        + TOOLS_TEMPLATE
    )
    tokenizer = planner_tokenizer(None, template)
    intake = Intake(tokenizer, (2,), vocab_size=len(tokenizer), max_seq_len=2048)
    chat = [{"role": "system", "content": "Be brief."}, *QUESTION]
    request = client_pb2.GenerateRequest(
        chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(**m) for m in chat]),
        max_tokens=4,
        conversation_id="c",
        shared_prefix=client_pb2.SharedPrefix(messages=1),
    )
    req = intake._make_request(request, "r")
    assert req.prompt_ids == chat_ids(tokenizer, chat, {})
    assert req.root is None and req.pinned is None
    assert "the shared prefix's messages alone do not render" in req.pin_note
    assert "a chat ends with a user turn" in req.pin_note


# ---- over the stack ----


@pytest.mark.asyncio(loop_scope="session")
async def test_the_model_reads_the_template_rendered_with_the_requests_variables(templated):
    stack, planner, client, model = templated.stack, templated.planner, templated.client, templated.model
    fields = dict(model=model, messages=QUESTION, max_tokens=6, temperature=0)
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = chat_ids(stack.planner.tokenizer, QUESTION, kwargs)
        by_ids = await planner.generate_all(GenerateOptions(token_ids=rendered, max_tokens=6))
        extra = {"return_token_ids": True, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        reply = await client.chat.completions.create(**fields, extra_body=extra)
        assert reply.usage.prompt_tokens == len(rendered)
        assert reply.choices[0].model_extra["token_ids"] == by_ids.token_ids
        over_grpc = await planner.generate_all(
            GenerateOptions(chat=QUESTION, chat_template_kwargs=kwargs, max_tokens=6)
        )
        assert (over_grpc.prompt_tokens, over_grpc.token_ids) == (len(rendered), by_ids.token_ids)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_bad_variable_is_a_400_that_harms_no_later_request(templated):
    client, model = templated.client, templated.model
    fields = dict(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    before = await client.chat.completions.create(**fields)
    for kwargs, says in (
        ({"tokenize": False}, "'tokenize' is the template's own variable"),
        ({"not-a-name": 1}, "must be an identifier"),
        ({"self": 1}, "'self' is the template's own variable"),
        ({"range": 1}, "'range' is the template's own variable"),
    ):
        with pytest.raises(openai.BadRequestError, match=says):
            await client.chat.completions.create(**fields, extra_body={"chat_template_kwargs": kwargs})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        await client.chat.completions.create(
            **fields, extra_body={"chat_template_kwargs": ["enable_thinking"]}
        )
    after = await client.chat.completions.create(**fields)
    assert after.choices[0].message.content == before.choices[0].message.content
