"""n > 1: the other choices of a request (the same prompt and controls, choice i drawing from seed + i), let
in once the first has read the prompt so they share its pages (the prefix index), and their streams merged
into one with each response's index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from planner_svc.requests import Phase, Request
from protos import client_pb2

PREFILL_POLL_S = 0.005  # how often the other choices look whether the first has read the prompt
_ENDED = object()


def other_choices(first: Request, n: int) -> list[Request]:
    """Choices 1 to n - 1 of `first`: fresh requests of the same prompt, each with its own seed stream."""
    return [
        Request(
            first.request_id,
            first.prompt_ids,
            first.max_tokens,
            replace(first.sampling, seed=(first.sampling.seed + index) % 2**64),
            first.stop_ids,
            tenant=first.tenant,
            stop_strings=first.stop_strings,
            min_tokens=first.min_tokens,
            grammar=first.grammar,
            begins_in_thought=first.begins_in_thought,
            later_choice=True,  # queued at the first's tag (responses.py)
        )
        for index in range(1, n)
    ]


async def prompt_read(request: Request) -> None:
    """Returns once `request` has read its prompt (its full pages are in the prefix index) or has ended."""
    while request.phase in (Phase.WAITING, Phase.PREFILL) and request.finish is None:
        await asyncio.sleep(PREFILL_POLL_S)


async def merged(
    streams: list[AsyncIterator[client_pb2.GenerateResponse]],
) -> AsyncIterator[client_pb2.GenerateResponse]:
    """The choices' responses as they come, each with its index, until every stream has ended; an error in
    one (a status the stream set) ends them all."""
    out: asyncio.Queue[object] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[client_pb2.GenerateResponse]) -> None:
        try:
            async for response in stream:
                response.index = index
                out.put_nowait(response)
        except BaseException as error:
            out.put_nowait(error)
        finally:
            out.put_nowait(_ENDED)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await out.get()
            if item is _ENDED:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                assert isinstance(item, client_pb2.GenerateResponse)
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
