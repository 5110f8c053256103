"""Counting the event loop's turns while a coroutine runs: a task that yields once a turn shows the loop was free."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


@contextlib.asynccontextmanager
async def loop_turns() -> AsyncIterator[Callable[[], int]]:
    """Yields a function giving the turns the loop has taken since the block began."""
    turns = 0

    async def tick() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker's first turn, before the block's work
    start = turns
    try:
        yield lambda: turns - start
    finally:
        ticker.cancel()
