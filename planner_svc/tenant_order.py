"""Where a request joins the waiting queue: tenants take turns (start-time fair queueing, a request a unit).

Each request gets a tag when it is queued: one past the later of the clock and its tenant's previous tag. The
queue stays ordered by tag, ties in arrival order. The clock is the tag just before the queue's head (with
nothing waiting, the last tag admitted), so requests admitted past a head waiting for pages do not move it. One
tenant's requests thus keep first come, first served; a request queued behind another tenant's backlog waits
for about one request of each tenant with requests waiting, not for the backlog; a tenant idle for a while
starts at the clock, with no turns saved up. Admission (admission.py) takes the queue in order, a head waiting
for pages passed by a bounded number of requests.
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
        self.clock = 0
        self._admitted = 0  # the greatest tag admitted
        self._last: dict[str, int] = {}  # tenant -> its latest tag

    def place(self, waiting: deque[T], request: T) -> None:
        """Tag the request and insert it into `waiting` (ordered by tag) after every tag up to its own."""
        tag = max(self.clock, self._last.get(request.tenant, 0)) + 1
        self._last[request.tenant] = request.queue_tag = tag
        waiting.insert(bisect.bisect_right(waiting, tag, key=lambda r: r.queue_tag), request)

    def admitted(self, request: Queued) -> None:
        self._admitted = max(self._admitted, request.queue_tag)

    def settle(self, waiting: deque[T]) -> None:
        """After an admission pass: the clock moves up to the queue's head."""
        head = waiting[0].queue_tag - 1 if waiting else self._admitted
        self.clock = max(self.clock, head)
        if len(self._last) > _PRUNE_AT:  # a tenant at or behind the clock starts at the clock anyway
            self._last = {tenant: tag for tenant, tag in self._last.items() if tag > self.clock}

    def forget(self, waiting: deque[T], request: T) -> None:
        """It left `waiting` unadmitted (aborted, refused): a tenant is not charged turns its requests never
        took, so its next tag follows the tenant's latest one still waiting."""
        if self._last.get(request.tenant) != request.queue_tag:
            return
        tags = [r.queue_tag for r in waiting if r.tenant == request.tenant]
        if tags:
            self._last[request.tenant] = max(tags)
        else:
            del self._last[request.tenant]
