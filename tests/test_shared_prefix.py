"""Shared prefixes resolve to the longest common start of the prompt's ids; malformed ones are refused."""

from __future__ import annotations

import re

import pytest

from planner_svc.shared_prefix import resolve_shared_prefix


def render(messages):
    """A toy chat template: each message is its role id then its characters' codes."""
    ids = []
    for m in messages:
        ids += [1000 + len(m["role"])] + [ord(c) for c in m["content"]] + [999]
    return ids


MESSAGES = [{"role": "system", "content": "doc text"}, {"role": "user", "content": "question?"}]
PROMPT = render(MESSAGES) + [7, 7]  # the generation prompt


def test_tokens_messages_and_chars():
    assert resolve_shared_prefix("tokens", 5, PROMPT, MESSAGES, render)[0] == 5
    assert resolve_shared_prefix("messages", 1, PROMPT, MESSAGES, render)[0] == len(render(MESSAGES[:1]))
    # the cut message ends with its end marker, which the prompt does not have there: the common start stops
    tokens, _ = resolve_shared_prefix("message", (1, 3), PROMPT, MESSAGES, render)
    assert tokens == len(render(MESSAGES[:1])) + 1 + 3


def test_prefixes_that_cannot_be_marked_are_ignored_with_a_reason():
    assert resolve_shared_prefix(None, 0, PROMPT, MESSAGES, render) == (None, "no shared prefix")
    tokens, why = resolve_shared_prefix("tokens", len(PROMPT) + 5, PROMPT, MESSAGES, render)
    assert tokens is None and "whole prompt" in why
    tokens, why = resolve_shared_prefix("messages", 0, PROMPT, MESSAGES, render)
    assert tokens is None and "no token" in why


@pytest.mark.parametrize(
    "kind, value, messages, message",
    [
        ("tokens", -1, MESSAGES, "tokens must be >= 0"),
        ("messages", 3, MESSAGES, "messages must be in [0, 2]"),
        ("message", (2, 1), MESSAGES, "must name a message in [0, 2)"),
        ("message", (0, -1), MESSAGES, "chars >= 0"),
        ("messages", 1, None, "needs a chat prompt"),
    ],
)
def test_malformed_fields_raise(kind, value, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_shared_prefix(kind, value, PROMPT, messages, render)
