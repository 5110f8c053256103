"""A chat's extra chat-template variables (OpenAI-style servers' chat_template_kwargs, such as Qwen3's
enable_thinking), parsed from the JSON text the wire carries and checked: pure, no tokenizer."""

from __future__ import annotations

import json
from typing import Any

MAX_TEMPLATE_KWARGS = 32
# Names the chat template is given whatever a request says, besides apply_chat_template's own parameters
# (the tokenizer's edge adds those, and its special tokens): the messages, and transformers' template globals.
TEMPLATE_NAMES = frozenset({"messages", "raise_exception", "strftime_now", "dict", "namespace"})


def parse_template_kwargs(text: str, reserved: frozenset[str]) -> dict[str, Any]:
    """The variables of `text`, a JSON object ("" is none); ValueError says what is wrong. A key must be an
    identifier (what a template can name) and none of `reserved`, the names the template already gets: a
    request may add variables, never replace the messages or the tokenizer's own."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as error:  # JSONDecodeError
        raise ValueError(f"chat template kwargs are not valid JSON: {error}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise ValueError("chat template kwargs are nested too deeply") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat template kwargs must be a JSON object, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat template kwargs: at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}")
    for key in kwargs:
        if not key.isidentifier():
            raise ValueError(f"chat template kwargs: a key must be an identifier, got {key!r}")
        if key in reserved or key in TEMPLATE_NAMES:
            raise ValueError(f"chat template kwargs: {key!r} is the template's own variable, not a request's")
    return kwargs
