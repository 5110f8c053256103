"""Prompts to token ids with the model's own tokenizer and chat template, and tokens back to text."""

from __future__ import annotations


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


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
