"""The gateway's Prometheus metrics: HTTP answers by path and status, counted as their status goes out."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")  # others count as "other"
CONVERSATION = "/v1/conversations/"  # counted under one label whatever the id (ids are unbounded)
MODEL = "/v1/models/"  # as CONVERSATION: a name asked for is the caller's to choose


Count = Callable[[str, str], None]  # one answer's (path, status)


def _label(path: str) -> str:
    if path in PATHS:
        return path
    if path.startswith(CONVERSATION):
        return CONVERSATION + "{conversation_id}"
    return MODEL + "{model}" if path.startswith(MODEL) else "other"


def count_into(registry: CollectorRegistry) -> Count:
    """deltaserve_http_responses_total{path, status} in `registry` (made once per registry)."""
    counter = Counter(
        "deltaserve_http_responses",
        "HTTP answers of the OpenAI-compatible API, by path and status",
        ["path", "status"],
        registry=registry,
    )
    return lambda path, status: counter.labels(path, status).inc()


class CountResponses:
    """ASGI middleware: each answer's (path, status) to `count` (a stream counts once, at its start)."""

    def __init__(self, app: ASGIApp, count: Count) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = _label(scope["path"])

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(path, str(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)
