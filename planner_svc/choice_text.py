"""One choice's tokens made into its client messages: the text (incremental, UTF-8 safe) and where a stop
string ends it (stop_strings.py), token by token where the request has stop strings."""

from __future__ import annotations

from planner_svc.stop_strings import StopStrings
from planner_svc.tokenizer import IncrementalDetokenizer


class ChoiceText:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStrings(stop_strings) if stop_strings else None
        self._min_tokens = min_tokens
        self._tokens = 0  # output tokens so far

    def add(self, token_ids: list[int]) -> tuple[list[int], str, str | None]:
        """The tokens to send, their text, and the stop string matched (None: none). On a match the tokens end
        with the one that completed it (those after are dropped) and the text ends before it."""
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

    def flush(self) -> str:
        """Text held back as the possible start of a stop string, at the choice's end."""
        return self._stops.flush() if self._stops is not None else ""
