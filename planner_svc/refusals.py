"""The requests Generate refuses before admission (a full queue, one that never fits, an invalid one, no
executor, a drain, a request id taken, a key refused; one refused while it waited, `from_queue`): each counted
by its status code's name in deltaserve_requests_refused_total, where no other metric sees it (`ended` counts
admitted requests only).

A refused API key (none, an unknown one: the interceptor's, protos/auth.py; a tenant key acting for another
tenant) is also said at warning level, at most once every KEY_WARNING_S seconds with how many were refused
since: a caller without a key cannot fill the log. Never the key itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn

import grpc
import structlog

from planner_svc.metrics import PlannerMetrics
from protos import client_pb2
from protos.auth import key_tenant

log = structlog.get_logger("deltaserve.planner")

GENERATE = f"/{client_pb2.DESCRIPTOR.services_by_name['Planner'].full_name}/Generate"
KEY_WARNING_S = 10.0
_KEY_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Refusals:
    """Counts and says refusals; `metrics` reads the servicer's (None: not served) when one happens."""

    def __init__(self, metrics: Callable[[], PlannerMetrics | None]) -> None:
        self.metrics = metrics
        self.keys_refused = 0  # since the last warning
        self.said_at: float | None = None

    async def refuse(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, trailing=()
    ) -> NoReturn:
        """Ends a Generate call not admitted with `code`, counted."""
        self._count(GENERATE, code)
        if code in _KEY_CODES:
            self._key_refused(GENERATE, code, message, key_tenant())
        await context.abort(code, message, trailing_metadata=trailing)
        raise AssertionError("abort raises")  # pragma: no cover

    def from_queue(self, code: str) -> None:
        """A Generate call whose request was refused while it waited (Engine.refuse: no state slot will come back
        for it), never admitted; its stream has ended with `code`."""
        self._count(GENERATE, grpc.StatusCode[code])

    def key_refused(self, method: str, why: str) -> None:
        """The interceptor's UNAUTHENTICATED (no key, an unknown one), of any of this planner's methods."""
        self._count(method, grpc.StatusCode.UNAUTHENTICATED)
        self._key_refused(method, grpc.StatusCode.UNAUTHENTICATED, why, None)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        metrics = self.metrics()
        if metrics is not None and method == GENERATE:
            metrics.refused.labels(code.name).inc()

    def _key_refused(self, method: str, code: grpc.StatusCode, why: str, tenant: str | None) -> None:
        self.keys_refused += 1
        now = time.monotonic()
        if self.said_at is not None and now - self.said_at < KEY_WARNING_S:
            return
        log.warning(
            "API key refused",
            method=method,
            code=code.name,
            why=why,
            key_tenant=tenant,
            refused=self.keys_refused,  # this one and those not said since the last warning
        )
        self.said_at, self.keys_refused = now, 0
