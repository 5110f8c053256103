"""A card's copy stream for park and restore: made lazily by the first copy (the one thing a restore can
allocate on a card, which the restore guard checks for), and what the guard samples of the card."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from executor_svc.restore_guard import CardSample

FreeMemory = Callable[[], int]  # free bytes of the card; raises RuntimeError when it cannot be sampled


class CopyStream:
    """The stream and event that page copies run on, after the work queued so far on the card and before
    any queued after them. On the CPU there is no card and nothing to make (but `free_memory` makes the
    guard apply as if there were one: the CPU tests of a refused restore)."""

    def __init__(self, device: torch.device, free_memory: FreeMemory | None = None) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # before, after the copies
        self._used = False  # the first copy ran (on the CPU: what `ready` reports)
        if free_memory is None and self._cuda:
            free_memory = self._cuda_free_memory
        self.free_memory = free_memory

    def _cuda_free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    @property
    def ready(self) -> bool:
        """The stream and event exist: a restore allocates nothing more on this card."""
        return self._stream is not None if self._cuda else self._used

    def cards(self) -> list[CardSample]:
        """The guard's sample of this card (none on the CPU without a memory query)."""
        if self.free_memory is None:
            return []
        try:
            free: int | None = self.free_memory()
        except RuntimeError:
            free = None  # no sample: go ahead
        return [CardSample(str(self.device), free, self.ready)]

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """The body's copies run on the copy stream, between the card's work queued before and after."""
        self._used = True
        if not self._cuda:
            yield
            return
        if self._stream is None:  # the first use on this card: its stream and events, made once
            self._stream = torch.cuda.Stream(self.device)
            self._events = torch.cuda.Event(), torch.cuda.Event()
        assert self._events is not None
        before, after = self._events
        main = torch.cuda.current_stream(self.device)
        before.record(main)
        self._stream.wait_event(before)
        with torch.cuda.stream(self._stream):
            yield
        after.record(self._stream)
        main.wait_event(after)
