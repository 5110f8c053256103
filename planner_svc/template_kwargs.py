"""A chat's extra chat-template variables (OpenAI-style servers' chat_template_kwargs, such as Qwen3's
enable_thinking), parsed from the JSON text the wire carries and checked: pure, no tokenizer."""

from __future__ import annotations

from typing import Any

from planner_svc.validation import InvalidRequest, json_field

MAX_TEMPLATE_KWARGS = 32
# Objects and arrays nested, the kwargs' own object the first: transformers copies the values recursively
# (~450 levels overflow).
MAX_TEMPLATE_KWARGS_DEPTH = 32


def parse_template_kwargs(text: str, reserved: frozenset[str]) -> dict[str, Any]:
    """The variables of `text`, a JSON object ("" is none); InvalidRequest says what is wrong. A key must be an
    identifier (what a template can name) and none of `reserved`, the names the template already gets: a
    request may add variables, never replace the messages, the template's functions or the tokenizer's own."""
    if not text:
        return {}
    kwargs = json_field("chat_template_kwargs", text, MAX_TEMPLATE_KWARGS_DEPTH)
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"chat_template_kwargs must be a JSON object, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(
            f"chat_template_kwargs has at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}"
        )
    for key in kwargs:
        if not key.isidentifier():
            raise InvalidRequest(f"chat_template_kwargs: a key must be an identifier, got {key!r}")
        if key in reserved:
            raise InvalidRequest(
                f"chat_template_kwargs: {key!r} is the template's own variable, not a request's"
            )
    return kwargs
