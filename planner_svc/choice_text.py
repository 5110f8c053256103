"""One choice's tokens made into its client messages: the text (incremental, UTF-8 safe), where a stop string
ends it (stop_strings.py, fed token by token where the request has stop strings), and each token's logprobs
with their tokens' text."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

from planner_svc.logprobs import LogprobRow
from planner_svc.stop_strings import StopStrings
from planner_svc.tokenizer import IncrementalDetokenizer
from protos import client_pb2


class ChoicePiece(NamedTuple):
    token_ids: list[int]
    text: str
    stop_string: str | None  # the stop string matched: the tokens end with the one that completed it
    logprobs: list[client_pb2.TokenLogprobs]  # one per token, where the request asked


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode), reversed: the byte each character stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenTexts:
    """Each token's own text and raw bytes, cached (the logprobs name up to 21 tokens a step)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, client_pb2.TokenLogprob] = {}

    def logprob(self, token_id: int, logprob: float) -> client_pb2.TokenLogprob:
        known = self._cache.get(token_id)
        if known is None:
            text = self._tokenizer.decode([token_id])
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            byte_of = _byte_of_char()
            raw = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else text.encode()
            known = self._cache[token_id] = client_pb2.TokenLogprob(
                token_id=token_id, token=text, token_bytes=raw
            )
        entry = client_pb2.TokenLogprob()
        entry.CopyFrom(known)
        entry.logprob = logprob
        return entry


class ChoiceText:
    def __init__(
        self, tokenizer, stop_strings: tuple[str, ...] = (), min_tokens: int = 0, top_logprobs: int = -1
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStrings(stop_strings) if stop_strings else None
        self._min_tokens = min_tokens
        self._tokens = 0  # output tokens so far
        self._top = top_logprobs
        self._texts = TokenTexts(tokenizer) if top_logprobs >= 0 else None

    def add(self, token_ids: list[int], logprobs: Sequence[LogprobRow | None] = ()) -> ChoicePiece:
        """The tokens to send, their text, the stop string matched (None: none) and their logprobs. On a match
        the tokens end with the one that completed it (those after are dropped) and the text ends before it."""
        token_ids, text, matched = self._text(token_ids)
        entries = []
        if self._texts is not None:
            entries = [self._entry(token, row) for token, row in zip(token_ids, logprobs) if row is not None]
        return ChoicePiece(token_ids, text, matched, entries)

    def _text(self, token_ids: list[int]) -> tuple[list[int], str, str | None]:
        stops = self._stops
        if stops is None:
            self._tokens += len(token_ids)
            return token_ids, self._detokenizer.add(token_ids), None
        parts = []
        for count, token in enumerate(token_ids, start=1):
            self._tokens += 1
            text, matched = stops.feed(self._detokenizer.add([token]), armed=self._tokens >= self._min_tokens)
            parts.append(text)
            if matched is not None:
                return token_ids[:count], "".join(parts), matched
        return token_ids, "".join(parts), None

    def _entry(self, token: int, row: LogprobRow) -> client_pb2.TokenLogprobs:
        assert self._texts is not None
        top = [
            self._texts.logprob(int(i), float(v)) for i, v in zip(row.top_ids[: self._top], row.top_logprobs)
        ]
        return client_pb2.TokenLogprobs(chosen=self._texts.logprob(token, row.logprob), top=top)

    def flush(self) -> str:
        """Text held back as the possible start of a stop string, at the choice's end."""
        return self._stops.flush() if self._stops is not None else ""
