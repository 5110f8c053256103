"""Resolve a request's shared read-only prefix ({messages: K}, {message: I, chars: N}, {tokens: N}) to a
token count: the longest common start of the prompt's ids and the ids of that prefix alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner_svc.conversations import common_prefix

Messages = list[dict[str, Any]]


def resolve_shared_prefix(
    kind: str | None,
    value: int | tuple[int, int],
    prompt_ids: list[int],
    messages: Messages | None,
    render: Callable[[Messages], list[int]],
) -> tuple[int | None, str]:
    """Returns (tokens, why): tokens is None when the prefix cannot be marked (why says so).

    Raises ValueError for a malformed field (negative counts, an index past the messages, a message
    form without chat messages). `render` gives the ids of messages without a generation prompt.
    """
    if kind is None:
        return None, "no shared prefix"
    if kind == "tokens":
        assert isinstance(value, int)
        if value < 0:
            raise ValueError(f"shared_prefix.tokens must be >= 0, got {value}")
        ids = prompt_ids[:value]
    else:
        if messages is None:
            raise ValueError(f"shared_prefix.{kind} needs a chat prompt")
        if kind == "messages":
            assert isinstance(value, int)
            if not 0 <= value <= len(messages):
                raise ValueError(f"shared_prefix.messages must be in [0, {len(messages)}], got {value}")
            ids = render(messages[:value]) if value else []
        else:
            assert isinstance(value, tuple)  # kind "message": (index, chars)
            index, chars = value
            if not 0 <= index < len(messages) or chars < 0:
                raise ValueError(
                    f"shared_prefix.message must name a message in [0, {len(messages)}) and chars >= 0, "
                    f"got message {index}, chars {chars}"
                )
            cut = {**messages[index], "content": messages[index]["content"][:chars]}
            ids = render([*messages[:index], cut])
    tokens = common_prefix(ids, prompt_ids)
    if tokens == 0:
        return None, "the shared prefix shares no token with the prompt"
    if tokens >= len(prompt_ids):
        return None, f"the shared prefix covers the whole prompt ({len(prompt_ids)} tokens)"
    return tokens, f"pinned the first {tokens} tokens"
