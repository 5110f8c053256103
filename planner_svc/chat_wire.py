"""A client's chat (messages, their tool calls, the tools, the template's variables) as the wire's ChatMessages:
the JSON parts as strict JSON text, so that a mistake is a ValueError here, before any call."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from protos import client_pb2

_REQUIRED = {"role", "content"}
# an assistant's calls and thought; the call a tool message answers
_OPTIONAL = {"tool_calls", "reasoning", "tool_call_id"}


def _json_text(field: str, value: Any) -> str:
    """`value` as strict JSON text (no NaN or infinity); "" for none."""
    if not value:
        return ""
    if isinstance(value, Mapping) and not all(isinstance(key, str) for key in value):
        raise ValueError(f"{field}' keys must be strings, got {list(value)!r}")
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:  # a set, NaN, a value holding itself, ...
        raise ValueError(f"{field} must be JSON values: {error}") from None


def chat_messages(
    chat: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> client_pb2.ChatMessages:
    messages = []
    for i, message in enumerate(chat):
        if not isinstance(message, Mapping) or not _REQUIRED <= set(message) <= _REQUIRED | _OPTIONAL:
            raise ValueError(
                f"chat message {i} must be a dict with 'role' and 'content' (and an assistant's 'tool_calls' and "
                f"'reasoning', or a tool's 'tool_call_id'), got {message!r}"
            )
        content = message["content"]
        if not isinstance(content, str | None):
            raise ValueError(f"chat message {i}'s content must be a string or None, got {content!r}")
        messages.append(
            client_pb2.ChatMessage(
                role=str(message["role"]),
                content=content or "",  # None: an assistant's turn of tool calls alone
                tool_calls=_json_text(f"chat message {i}'s tool_calls", message.get("tool_calls")),
                tool_call_id=str(message.get("tool_call_id") or ""),
                reasoning=str(message.get("reasoning") or ""),
            )
        )
    return client_pb2.ChatMessages(
        messages=messages,
        template_kwargs=_json_text("chat_template_kwargs", dict(template_kwargs or {})),
        tools=_json_text("tools", list(tools or ())),
    )
