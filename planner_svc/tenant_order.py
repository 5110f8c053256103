"""Where a request joins the waiting queue: tenants take turns (start-time fair queueing, a request a unit).

Each request gets a tag when it is queued: one past the later of the tag last admitted (the clock) and its
tenant's previous tag. The queue stays ordered by tag, ties in arrival order. One tenant's requests thus keep
first come, first served; a tenant with hundreds waiting does not hold back another's request by more than a
request of each tenant with one waiting, and a tenant idle for a while starts at the clock, with no credit
saved up. Admission (admission.py) still takes the queue in order, a head waiting for pages passed by a bounded
number of requests.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Protocol, TypeVar


class Queued(Protocol):
    tenant: str
    queue_tag: int


T = TypeVar("T", bound=Queued)

_PRUNE_AT = 1024  # tenants remembered before those whose last tag the clock has passed are forgotten


class TenantOrder:
    def __init__(self) -> None:
        self.clock = 0  # the greatest tag admitted
        self._last: dict[str, int] = {}  # tenant -> its latest tag

    def place(self, waiting: deque[T], request: T) -> None:
        """Tag the request and insert it into `waiting` (ordered by tag) after every tag up to its own."""
        tag = max(self.clock, self._last.get(request.tenant, 0)) + 1
        self._last[request.tenant] = request.queue_tag = tag
        waiting.insert(bisect.bisect_right(waiting, tag, key=lambda r: r.queue_tag), request)

    def admitted(self, request: Queued) -> None:
        self.clock = max(self.clock, request.queue_tag)
        if len(self._last) > _PRUNE_AT:  # a tenant at or behind the clock starts at the clock anyway
            self._last = {tenant: tag for tenant, tag in self._last.items() if tag > self.clock}
