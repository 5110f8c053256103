"""Runs an async main on uvloop when installed, SIGINT/SIGTERM/SIGHUP setting a stop event; races work against
it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

T = TypeVar("T")

# SIGHUP too: a closed terminal or a "reload" would otherwise kill the process without its drain (nothing is
# reloaded: keys, certificates and flags are read at start).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(
    main: Callable[[asyncio.Event], Awaitable[T]],
    signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
    *,
    stop_on_stdin_close: bool = False,
) -> T:
    """Runs `main(stop)` to completion and returns its result.

    The first of `signals` (SIGINT, SIGTERM, SIGHUP) sets `stop`, so `main` can stop its servers with a grace
    period.
    The handlers are removed at that point, so a second signal acts as usual (Ctrl-C raises
    KeyboardInterrupt, SIGTERM terminates) when a shutdown hangs.

    stop_on_stdin_close: the end of standard input sets `stop` instead, and the stop signals are ignored: a
    process its parent stops by closing the pipe (an `up` stage), which a signal to the parent's group or
    control group must not stop before the parent drains, and which stops when the parent dies, however.
    """
    if stop_on_stdin_close:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        signals = ()

    async def main_with_signals() -> T:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        installed: list[signal.Signals] = []
        if stop_on_stdin_close:
            _stop_at_end_of_stdin(loop, stop)

        def on_signal() -> None:
            stop.set()
            for sig in installed:
                loop.remove_signal_handler(sig)
            installed.clear()

        for sig in signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:  # under nohup: left ignored
                continue
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread, or a platform without loop signal handlers
            installed.append(sig)
        try:
            return await main(stop)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        return runner.run(main_with_signals())


def _stop_at_end_of_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    fd = sys.stdin.fileno()

    def on_readable() -> None:
        if not os.read(fd, 4096):  # the end: the writer closed it or is gone
            loop.remove_reader(fd)
            stop.set()

    loop.add_reader(fd, on_readable)


async def until_stopped(
    awaitable: Awaitable[T], stop: asyncio.Event
) -> tuple[Literal[True], T] | tuple[Literal[False], None]:
    """(True, result) when `awaitable` finishes first; (False, None) when `stop` is set first (then it is
    cancelled)."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((work, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if work.done():
        return True, work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return False, None
