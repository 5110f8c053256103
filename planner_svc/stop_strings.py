"""Stop strings matched on a stream of text pieces, across token boundaries: pure, no tokenizer."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """What of a choice's text can go out, and where a stop string ends it.

    Text that could still be the start of a stop string is held back until the next piece decides it, so
    no client ever sees part of a stop string; the match and everything after it never go out.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string cannot be empty")
        self.stops = tuple(stops)
        self._held = ""  # text not yet emitted: the longest end of it that starts some stop string

    def feed(self, piece: str, armed: bool = True) -> tuple[str, str | None]:
        """The text that can go out after `piece`, and the stop string matched (None: no match yet). On a
        match the text is what came before it. Unarmed (min_tokens not reached), nothing matches and
        nothing is held."""
        text = self._held + piece
        if not armed:
            self._held = ""
            return text, None
        match: tuple[int, str] | None = None  # (where, which): the earliest, then the first listed
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (match is None or at < match[0]):
                match = (at, stop)
        if match is not None:
            self._held = ""
            return text[: match[0]], match[1]
        held = max((_overlap(text, stop) for stop in self.stops), default=0)
        self._held = text[len(text) - held :]
        return text[: len(text) - held], None

    def flush(self) -> str:
        """The text held back, at the choice's end without a match."""
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a proper start of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
