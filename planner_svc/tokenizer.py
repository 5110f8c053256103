"""Prompts to token ids with the model's own tokenizer and chat template, and tokens back to text."""

from __future__ import annotations

import inspect
from typing import Any

import jinja2

from protos.model_files import load_tokenizer
from protos.thought import opens_thought

# What rendering a chat raises for the chat's own sake: the template refuses the messages (raise_exception), or a
# request's variable has a type the template cannot use (a TypeError inside it), or nests too deep to copy.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, RecursionError)


# The tokens of a chat prompt's end that say whether its template opened a thought: the tag's and white space's
# (Qwen3.5's "<think>\n" is two; a tokenizer without the tag as a token spells it in a few).
THOUGHT_TAIL_TOKENS = 16

# Names a chat template is given besides apply_chat_template's parameters, the special tokens and Jinja's own
# globals: the messages, and the globals transformers adds.
TEMPLATE_NAMES = frozenset({"messages", "raise_exception", "strftime_now", "dict", "namespace"})


class TemplateRefused(ValueError):
    """The chat template could not render a chat (INVALID_ARGUMENT)."""


def planner_tokenizer(model: str | None, chat_template: str | None):
    """The model's tokenizer, with `chat_template` (a Jinja template's text) in place of its own where one is
    given: for a checkpoint that has none, or to serve another. ValueError for a template that does not parse."""
    tokenizer = load_tokenizer(model)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        try:  # transformers compiles a template when it first renders one
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not parse: {error} (line {error.lineno})") from None
        except _RENDER_ERRORS:  # it parses, and refuses this chat: a template may ask for a system turn
            pass
    return tokenizer


def chat_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
) -> list[int]:
    """The ids of a chat rendered by the chat template, `template_kwargs` its request's extra variables; ending
    with the assistant's turn opened unless `add_generation_prompt` is false (a history's rendering).
    TemplateRefused when the template cannot render it."""
    try:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except _RENDER_ERRORS as error:
        raise TemplateRefused(f"chat: the chat template refused the messages: {error}") from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


def begins_in_thought(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a rendered chat's answer begins inside a thought: its template opened one at its end (a template
    with thinking off closes an empty one)."""
    return opens_thought(tokenizer.decode(prompt_ids[-THOUGHT_TAIL_TOKENS:], skip_special_tokens=False))


def reserved_template_names(tokenizer) -> frozenset[str]:
    """The names a request's chat template kwargs may not take, all of them given to the template already:
    apply_chat_template's own parameters (a kwarg `tokenize` would change what it returns), the tokenizer's
    special tokens, the messages, and Jinja's and transformers' globals (`range`, `raise_exception`)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    names = set(jinja2.defaults.DEFAULT_NAMESPACE) | TEMPLATE_NAMES
    names.update(inspect.signature(type(tokenizer).apply_chat_template).parameters)  # `self` too
    names.update(inspect.signature(render_jinja_template).parameters)
    names.update(tokenizer.special_tokens_map)
    return frozenset(names)


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


class IncrementalDetokenizer:
    """Text for each batch of new tokens, holding back bytes of a character not yet complete. Special tokens
    (the chat template's end-of-turn that stops an answer) have no text."""

    def __init__(self, tokenizer) -> None:
        # The Rust tokenizer's own decode where transformers' wrapper adds nothing to it (no clean-up of
        # tokenization spaces): the same text at ~2.7x less host time, and this runs for every stream write.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode = backend.decode
        else:
            self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # tokens before this were emitted and need no context
        self._read = 0  # tokens up to this have been emitted

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        decode = self._decode
        emitted = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        text = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]
