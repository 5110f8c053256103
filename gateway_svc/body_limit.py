"""A bound on request bodies: one over it is a 413 before the gateway parses it (by its Content-Length) or as
it arrives (a chunked one), never a body held whole and then refused by gRPC's message limit as a 429."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway_svc.http_errors import ApiError

MAX_BODY_BYTES = 32 << 20  # half the planner client's 64 MiB message limit: a prompt that fits stays under it


def _too_large(limit: int) -> str:
    return f"the request body is over {limit} bytes, the gateway's bound"


class BodyLimit:
    """ASGI middleware refusing bodies over `limit` bytes with a 413 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await ApiError(413, _too_large(self.limit)).response()(scope, receive, send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                # raised inside the app, where FastAPI lets an HTTPException through its body parsing to the
                # error handlers (any other error there becomes a 400 "error parsing the body")
                if received > self.limit:
                    raise HTTPException(413, _too_large(self.limit))
            return message

        await self.app(scope, bounded, send)
