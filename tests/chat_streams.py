"""A streamed chat completion held open over HTTP, for the tests that act while a turn runs."""

import contextlib
from collections.abc import AsyncIterator

import httpx2 as httpx


@contextlib.asynccontextmanager
async def streaming_turn(client: httpx.AsyncClient, body: dict) -> AsyncIterator[httpx.Response]:
    """POSTs `body` (streamed) to /v1/chat/completions and yields the reply once its first event is read: the
    turn is running for as long as the block runs, and the stream closes when it ends."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = reply.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass
        yield reply
