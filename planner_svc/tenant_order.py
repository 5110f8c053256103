"""Where a request joins the waiting queue: tenants take turns (start-time fair queueing, weighted by tokens).

A request costs the positions it holds once admitted (`end_len`: its prompt and max_tokens; admission gives
it every page it can write), once for each of its n choices: choices 2 to n are queued once the first has read
the prompt, at the first's place, charged with it. It gets a start tag when it is queued, the later of the
clock and where its tenant's previous request ends (that one's start tag plus its cost). The queue stays
ordered by start tag, ties in arrival order. The clock is the head's start tag (with nothing waiting, where the
requests admitted end), so requests admitted past a head waiting for pages do not move it. One tenant's
requests thus keep first come, first served; a request queued behind another tenant's backlog waits for about
one turn of each tenant with requests waiting, not for the backlog, and a turn is tokens, not requests: a
tenant of short requests gets many through for another's long one; a tenant idle for a while starts at the
clock, with no turns saved up. Admission (admission.py) takes the queue in order, a head waiting for pages
passed by a bounded number of requests.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Protocol, TypeVar


class Queued(Protocol):
    tenant: str
    queue_tag: int  # its start tag
    n: int
    later_choice: bool

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
        """Tag the request and insert it into `waiting` (ordered by start tag) after every tag up to its own.
        A later choice comes with its first's tag: it goes before its tenant's requests queued since."""
        if not request.later_choice:
            request.queue_tag = max(self.clock, self._last.get(request.tenant, 0))
            self._last[request.tenant] = _end(request)
        _insert(waiting, request)

    def admitted(self, request: Queued) -> None:
        self._admitted = max(self._admitted, _end(request))

    def settle(self, waiting: deque[T]) -> None:
        """After an admission pass: the clock moves up to the queue's head."""
        self.clock = max(self.clock, waiting[0].queue_tag if waiting else self._admitted)
        if len(self._last) > _PRUNE_AT:  # a tenant at or behind the clock starts at the clock anyway
            self._last = {tenant: end for tenant, end in self._last.items() if end > self.clock}

    def forget(self, waiting: deque[T], request: T) -> None:
        """It left `waiting` unadmitted (aborted, refused): its tenant is not charged for it. The tenant's
        requests queued after it move up by its cost, not past the clock (one requeued by a recovery may be
        behind it, and those after it were not tagged from it), as does where the tenant's next one starts. (A
        later choice was charged with its first, which ran.)"""
        cost, tenant = _cost(request), request.tenant
        if not cost:
            return
        moved = False
        for other in waiting:
            if other.tenant == tenant and other.queue_tag > request.queue_tag and _cost(other):
                other.queue_tag = max(self.clock, other.queue_tag - cost)
                moved = True
        if moved:  # one pass: a whole backlog cancelled one by one stays quadratic, not cubic
            ordered = sorted(waiting, key=lambda r: r.queue_tag)
            waiting.clear()
            waiting.extend(ordered)
        if tenant in self._last:
            self._last[tenant] = max(self.clock, self._last[tenant] - cost)


def _cost(request: Queued) -> int:
    return 0 if request.later_choice else request.end_len * request.n


def _end(request: Queued) -> int:
    return request.queue_tag + _cost(request)


def _insert(waiting: deque[T], request: T) -> None:
    waiting.insert(bisect.bisect_right(waiting, request.queue_tag, key=lambda r: r.queue_tag), request)
