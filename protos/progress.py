"""Progress of long work a person waits on (model load, a benchmark's rounds): a bar redrawn in place on a
terminal, a log line every few seconds otherwise (JSON logs, a file, a container's output).

    with Progress("loading SmolLM2", total=272, unit="tensors") as progress:
        for tensor in tensors:
            ...
            progress.advance()
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("deltaserve.progress")

BAR_WIDTH = 30
LOG_INTERVAL_S = 5.0
REDRAW_INTERVAL_S = 0.1


def describe(label: str, done: float, total: float, unit: str, elapsed_s: float) -> str:
    """'label: 120/272 tensors (44%), 3.1 s, 39 tensors/s' (no rate before any time has passed)."""
    percent = 100 * done / total if total else 100
    rate = f", {done / elapsed_s:.0f} {unit}/s" if elapsed_s > 0 and done else ""
    return f"{label}: {done:g}/{total:g} {unit} ({percent:.0f}%), {elapsed_s:.1f} s{rate}"


def bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    filled = width if not total else min(width, int(width * done / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Progress:
    """Counts `done` of `total`; shows it on `stream` when that is a terminal, else logs a line every
    `log_interval_s` (and one at the end). Nothing is shown for work that ends within `quiet_s`."""

    def __init__(
        self,
        label: str,
        total: float,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
        quiet_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = 0.0
        self._stream = sys.stderr if stream is None else stream
        self._terminal = self._stream.isatty()
        self._log_interval_s, self._quiet_s, self._clock = log_interval_s, quiet_s, clock
        self._began = self._last_shown = clock()
        self._shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        now = self._clock()
        elapsed = now - self._began
        if elapsed < self._quiet_s:
            return
        interval = REDRAW_INTERVAL_S if self._terminal else self._log_interval_s
        if now - self._last_shown >= interval or not self._shown:
            self._show(elapsed)
            self._last_shown = now

    def close(self) -> None:
        """The last line, when anything was shown (the bar gets its newline)."""
        if self._shown:
            self._show(self._clock() - self._began)
            if self._terminal:
                self._stream.write("\n")
                self._stream.flush()

    def _show(self, elapsed: float) -> None:
        self._shown = True
        line = describe(self.label, self.done, self.total, self.unit, elapsed)
        if self._terminal:
            self._stream.write(f"\r{bar(self.done, self.total)} {line}\x1b[K")
            self._stream.flush()
        else:
            log.info(line)
