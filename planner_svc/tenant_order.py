"""Where a request joins the waiting queue: tenants take turns (start-time fair queueing, weighted by tokens).

A request costs the positions it holds once admitted (`end_len`: its prompt and max_tokens; admission gives
it every page it can write). It gets a start tag when it is queued, the later of the clock and where its
tenant's previous request ends (that one's start tag plus its cost). The queue stays ordered by start tag, ties
in arrival order. The clock is the head's start tag (with nothing waiting, where the requests admitted end), so
requests admitted past a head waiting for pages do not move it. One tenant's requests thus keep first come,
first served; a request queued behind another tenant's backlog waits for about one turn of each tenant with
requests waiting, not for the backlog, and a turn is tokens, not requests: a tenant of short requests gets many
through for another's long one; a tenant idle for a while starts at the clock, with no turns saved up.
Admission (admission.py) takes the queue in order, a head waiting for pages passed by a bounded number of
requests.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Protocol, TypeVar


class Queued(Protocol):
    tenant: str
    queue_tag: int  # its start tag

    @property
    def end_len(self) -> int: ...


T = TypeVar("T", bound=Queued)

_PRUNE_AT = 1024  # tenants remembered before those whose last tag the clock has passed are forgotten


class TenantOrder:
    def __init__(self) -> None:
        self.clock = 0
        self._admitted = 0  # the latest end of a request admitted
        self._last: dict[str, int] = {}  # tenant -> where its latest request ends

    def place(self, waiting: deque[T], request: T) -> None:
        """Tag the request and insert it into `waiting` (ordered by start tag) after every tag up to its own."""
        request.queue_tag = max(self.clock, self._last.get(request.tenant, 0))
        self._last[request.tenant] = _end(request)
        waiting.insert(bisect.bisect_right(waiting, request.queue_tag, key=lambda r: r.queue_tag), request)

    def admitted(self, request: Queued) -> None:
        self._admitted = max(self._admitted, _end(request))

    def settle(self, waiting: deque[T]) -> None:
        """After an admission pass: the clock moves up to the queue's head."""
        self.clock = max(self.clock, waiting[0].queue_tag if waiting else self._admitted)
        if len(self._last) > _PRUNE_AT:  # a tenant at or behind the clock starts at the clock anyway
            self._last = {tenant: end for tenant, end in self._last.items() if end > self.clock}

    def forget(self, waiting: deque[T], request: T) -> None:
        """It left `waiting` unadmitted (aborted, refused): a tenant is not charged turns its requests never
        took, so its next request starts where the tenant's latest one still waiting ends."""
        if self._last.get(request.tenant) != _end(request):
            return
        ends = [_end(r) for r in waiting if r.tenant == request.tenant]
        if ends:
            self._last[request.tenant] = max(ends)
        else:
            del self._last[request.tenant]


def _end(request: Queued) -> int:
    return request.queue_tag + request.end_len
