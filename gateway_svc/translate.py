"""OpenAI request bodies to the planner's GenerateOptions: pure, no I/O.

One body becomes one planner request per prompt (a text completion may carry several), each asking for the
body's `n` choices; choice index = prompt index x n + j, as OpenAI numbers them.
A field the gateway cannot honour is an UnsupportedField (a 400 naming it), never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from gateway_svc.openai_schema import ChatCompletionBody, ChatMessage, CompletionBody, GenerationBody
from gateway_svc.reasoning import REASONING_FIELDS
from gateway_svc.tool_calls import ToolSpec
from planner_svc.client import GenerateOptions

_TOKEN_ID = re.compile(r"-?[0-9]{1,10}")  # an int32's digits at most (int() refuses 4,301 and more)
MAX_COMPLETION_LOGPROBS = 20  # the alternatives the planner returns at most (its top_logprobs)

_FUNCTIONS = "functions and function_call are not supported: give tools and tool_choice"
_GUIDED = "is not supported (guided decoding): response_format takes json_object or a json_schema"
# The one list of fields the gateway cannot honour: body field -> (why it is refused, the values that mean "not
# asked for" even when a client sends them explicitly). A field is refused, with a 400 naming it, when it is set
# to anything else; the body declares it (openai_schema.py) or carries it among its unknown fields. Besides
# OpenAI's, vLLM's extensions that clients of vLLM send: the gateway honours top_k, min_p, repetition_penalty,
# min_tokens, stop_token_ids, ignore_eos and return_token_ids, and refuses these rather than ignore them.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "best_of": ("best_of is not supported", (None, 1)),
    "functions": (_FUNCTIONS, (None, [])),  # the deprecated spelling of tools
    "function_call": (_FUNCTIONS, (None, "none")),  # and of tool_choice
    "parallel_tool_calls": (
        "parallel_tool_calls false is not supported: an answer may make several calls",
        (None, True),
    ),
    "audio": ("audio is not supported", (None,)),
    "modalities": ("only text is supported", (None, ["text"])),
    "prediction": ("predicted outputs are not supported", (None,)),
    "echo": ("echo is not supported", (None, False)),
    "suffix": ("suffix (insertion) is not supported", (None,)),
    # vLLM's
    "guided_json": (f"guided_json {_GUIDED}", (None,)),
    "guided_regex": (f"guided_regex {_GUIDED}", (None,)),
    "guided_choice": (f"guided_choice {_GUIDED}", (None,)),
    "guided_grammar": (f"guided_grammar {_GUIDED}", (None,)),
    "structured_outputs": (f"structured_outputs {_GUIDED}", (None,)),
    "allowed_token_ids": ("allowed_token_ids is not supported", (None,)),
    "bad_words": ("bad_words is not supported", (None, [])),
    "use_beam_search": ("use_beam_search is not supported", (None, False)),
    "length_penalty": ("length_penalty (beam search's) is not supported", (None, 1.0)),
    "include_stop_str_in_output": (
        "include_stop_str_in_output is not supported: a matched stop string is left out of the output",
        (None, False),
    ),
    "prompt_logprobs": ("prompt_logprobs is not supported", (None,)),
    "truncate_prompt_tokens": ("truncate_prompt_tokens is not supported", (None,)),
    "skip_special_tokens": (
        "skip_special_tokens false is not supported: the text leaves them out",
        (None, True),
    ),
    "return_tokens_as_token_ids": ("return_tokens_as_token_ids is not supported", (None, False)),
    "logits_processors": ("logits_processors are not supported", (None, [])),
    "add_generation_prompt": (
        "add_generation_prompt false is not supported: a chat's prompt ends with the assistant's turn",
        (None, True),
    ),
    "continue_final_message": ("continue_final_message is not supported", (None, False)),
    "chat_template": (
        "chat_template is not supported: the server's template is used (its --chat-template)",
        (None,),
    ),
}


def _asks_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    """`value` is one of `harmless`, a boolean only as a boolean (True == 1 in Python)."""
    return any(value == h and isinstance(value, bool) == isinstance(h, bool) for h in harmless)


class UnsupportedField(ValueError):
    """A request field the gateway cannot honour (400); `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class BadField(ValueError):
    """A request field whose value is malformed or contradicts another (400); `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Choice:
    """One planner request: a prompt's n choices, numbered from `index` in the response."""

    index: int  # the index of its first choice in the response (prompt x n)
    prompt: int  # which prompt it answers (usage counts each prompt once)
    options: GenerateOptions
    tool_spec: ToolSpec | None = None  # the tools its answers may call, and whether they must

    def indices(self) -> range:
        return range(self.index, self.index + self.options.n)


def check_supported(body: GenerationBody) -> None:
    """UnsupportedField for the first field set, declared or not, that the gateway cannot honour."""
    extra = body.model_extra or {}
    for name, (why, harmless) in UNSUPPORTED.items():
        value = getattr(body, name) if name in type(body).model_fields else extra.get(name)
        if not _asks_nothing(value, harmless):
            raise UnsupportedField(name, why)


def conversation_of(body: GenerationBody, header: str | None) -> str:
    """The conversation: the body's conversation_id or the X-Conversation-Id header (the same if both)."""
    field = body.conversation_id or ""
    header = (header or "").strip()
    if field and header and field != header:
        raise BadField(
            "conversation_id",
            f"conversation_id {field!r} and the X-Conversation-Id header {header!r} differ; give one",
        )
    return field or header


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer ids; the planner checks the ranges."""
    if not bias:
        return None
    if not all(_TOKEN_ID.fullmatch(token) for token in bias):  # int() would read other scripts' digits too
        raise BadField("logit_bias", "logit_bias keys must be token ids (integers in ASCII digits)")
    ids = {int(token): value for token, value in bias.items()}
    if any(not -(2**31) <= token < 2**31 for token in ids):
        raise BadField("logit_bias", "logit_bias keys must be token ids, within the vocabulary")
    return ids


def _base_options(body: GenerationBody, conversation: str, max_tokens: int | None) -> GenerateOptions:
    if body.shared_prefix is not None and not conversation:
        raise BadField(
            "shared_prefix", "shared_prefix marks a conversation's prefix: give a conversation_id too"
        )
    return GenerateOptions(
        max_tokens=max_tokens or 0,  # 0: the planner's --default-max-tokens, else all that fit
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or ()),
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        logit_bias=_logit_bias(body.logit_bias),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        response_format=None if body.response_format in (None, {"type": "text"}) else body.response_format,
        conversation_id=conversation,
        tenant=body.tenant or "",
        shared_prefix=body.shared_prefix.as_mapping() if body.shared_prefix is not None else None,
    )


def _fan_out(prompts: list[GenerateOptions], n: int, seed: int | None, request_id: str) -> list[Choice]:
    """One request per prompt, asking the planner for its n choices (they share the prompt's pages; choice j
    draws from seed + j). Unseeded, the seed is left unset and the planner draws one for each request."""
    choices = []
    for p, options in enumerate(prompts):
        request = replace(options, request_id=f"{request_id}-{p}", seed=seed, n=n)
        choices.append(Choice(p * n, p, request))
    return choices


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string: the string, its text parts joined, or "" for none. A message
    carrying a function_call (tool_calls' deprecated form) is refused: the prompt would lose it."""
    if (message.model_extra or {}).get("function_call"):
        raise UnsupportedField(f"messages.{index}.function_call", f"messages[{index}]: {_FUNCTIONS}")
    if message.name:
        raise UnsupportedField(
            f"messages.{index}.name",
            f"messages[{index}].name is not supported: the chat template is given each message's role and "
            "content only",
        )
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text":
            raise UnsupportedField(
                f"messages.{index}.content",
                f"messages[{index}]: only text content parts are supported, got a part of type {part.type!r}",
            )
        if part.text is None:
            raise BadField(f"messages.{index}.content", f"messages[{index}]: a text content part has no text")
        texts.append(part.text)
    return "".join(texts)


def chat_choices(body: ChatCompletionBody, conversation_header: str | None, request_id: str) -> list[Choice]:
    check_supported(body)
    if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
        raise BadField("max_completion_tokens", "max_tokens and max_completion_tokens differ; give one")
    conversation = conversation_of(body, conversation_header)
    base = _base_options(body, conversation, body.max_completion_tokens or body.max_tokens)
    base = replace(
        base,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
    )
    chat = [_message(m, i) for i, m in enumerate(body.messages)]
    tools, spec = _tools(body)
    base = replace(base, chat=chat, chat_template_kwargs=body.chat_template_kwargs, tools=tools)
    if spec is not None and spec.mode != "auto":  # a forced call: the answer held to its schema
        if base.response_format is not None:
            raise BadField(
                "response_format", "response_format and a forced tool call both shape the answer: give one"
            )
        schema = {"name": spec.name or "tool_calls", "schema": spec.schema()}
        base = replace(base, response_format={"type": "json_schema", "json_schema": schema})
    return [
        replace(choice, tool_spec=spec) for choice in _fan_out([base], body.n or 1, body.seed, request_id)
    ]


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": message.role, "content": message_text(message, index)}
    if message.tool_calls:
        fields["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    thought = _thought(message, index)
    if thought:
        fields["reasoning"] = thought
    return fields


def _thought(message: ChatMessage, index: int) -> str | None:
    """An assistant message's thought, sent back as `reasoning` or (DeepSeek's name) `reasoning_content`."""
    given = {name: value for name in REASONING_FIELDS if (value := getattr(message, name)) is not None}
    if len(set(given.values())) > 1:
        raise BadField(
            f"messages.{index}.reasoning", f"messages[{index}]: reasoning and reasoning_content differ"
        )
    if given and message.role != "assistant":
        name = next(iter(given))
        raise BadField(
            f"messages.{index}.{name}", f"messages[{index}]: only an assistant's message has a thought"
        )
    return next(iter(given.values()), None)


def _tools(body: ChatCompletionBody) -> tuple[list[dict[str, Any]] | None, ToolSpec | None]:
    """The tools for the chat template, and the calls the answer makes: found in its text with tool_choice auto
    (the default), none with none, forced (held to a schema) with required or a named function."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise BadField("tool_choice", "tool_choice asks for a call of a tool: give tools")
        return None, None
    spec = ToolSpec.of(body.tools)
    if len(spec.parameters) < len(body.tools):  # the planner checks them too; here, named as HTTP names them
        raise BadField(
            "tools", 'each of tools must be {"type": "function", "function": {"name": ..., ...}}, named once'
        )
    if choice in (None, "auto"):
        return body.tools, spec
    if choice == "none":
        return body.tools, None
    if choice == "required":
        return body.tools, replace(spec, mode="required")
    function = (
        choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    )
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in spec.parameters:
        raise BadField(
            "tool_choice",
            'tool_choice takes auto, none, required or {"type": "function", "function": {"name": ...}} naming one '
            f"of the tools, got {repr(choice)[:200]}",
        )
    return body.tools, replace(spec, mode="named", name=name)


def _prompts(prompt) -> list[str | list[int]]:
    """A completion's prompt as a list of prompts: text or token ids each."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return list(prompt)


def completion_choices(
    body: CompletionBody, conversation_header: str | None, request_id: str
) -> list[Choice]:
    check_supported(body)
    conversation = conversation_of(body, conversation_header)
    prompts = _prompts(body.prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadField("prompt", "the prompt is empty")
    if conversation and len(prompts) > 1:
        raise BadField("prompt", "a conversation continues with one prompt, not a batch")
    base = _base_options(body, conversation, body.max_tokens or 16)  # OpenAI's completions default: 16
    if body.logprobs is not None and body.logprobs > MAX_COMPLETION_LOGPROBS:
        raise BadField("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}")
    if body.logprobs is not None:  # OpenAI's completions: logprobs N is the chosen token and N alternatives
        base = replace(base, logprobs=True, top_logprobs=body.logprobs)
    options = [
        replace(base, text=p) if isinstance(p, str) else replace(base, token_ids=tuple(p)) for p in prompts
    ]
    return _fan_out(options, body.n or 1, body.seed, request_id)
