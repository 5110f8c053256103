"""Which waiting requests get their pages: in the queue's order (tenant_order.py), with bounded skipping.

A head of the queue that cannot get its pages does not hold back the requests behind it that can: they go
past it, up to `skip_limit` of them while that request is the head. Then the head blocks again (nothing
passes it until its pages are free), so a large request waits for at most `skip_limit` later ones and
never starves. Only the first `scan_limit` waiting requests are looked at in a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

SCAN_LIMIT = 64


class Admission(Generic[T]):
    def __init__(self, skip_limit: int, scan_limit: int = SCAN_LIMIT):
        if skip_limit < 0:
            raise ValueError(f"skip_limit must be >= 0, got {skip_limit}")
        self.skip_limit = skip_limit
        self.scan_limit = scan_limit
        self._head: T | None = None  # the blocked head the count is for
        self.skipped = 0  # requests admitted past it

    def take(
        self, waiting: deque[T], fits: Callable[[T], bool], frees_head: Callable[[T], bool] | None = None
    ) -> Iterator[T]:
        """Removes from `waiting` and yields each request to admit now, in order. `fits` is asked again after
        each one (the caller gives the pages of one before the next is chosen). `frees_head`: those requests
        whose run frees what the head waits for, which pass it whatever the count."""
        at = 0
        while at < len(waiting) and at < self.scan_limit:
            request = waiting[at]
            if at and self.skipped >= self.skip_limit:
                if frees_head is None:
                    return  # the head blocks: nothing else passes it
                if not frees_head(request):
                    at += 1
                    continue
            if fits(request):
                del waiting[at]
                self.skipped += 1 if at else 0
                yield request
                continue
            if at == 0 and request is not self._head:
                self._head, self.skipped = request, 0
            at += 1

    def forget(self, request: T) -> None:
        """It left the queue without being admitted (aborted)."""
        if request is self._head:
            self._head, self.skipped = None, 0
