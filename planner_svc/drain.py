"""Draining a planner before it exits (SIGTERM, SIGHUP, Ctrl-C): nothing new is taken, running requests get the
drain timeout to finish and are then cut with UNAVAILABLE, every conversation still holding KV pages is
parked to the cache; only then may the server stop (DESIGN §7, invariant 9)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog

from planner_svc.parking import ParkError

if TYPE_CHECKING:
    from planner_svc.server import PlannerServicer
    from protos.rpc import StartedServer

log = structlog.get_logger("deltaserve.planner.drain")

DRAINING = "draining: the planner is shutting down; retry after its restart or on another planner"
POLL_S = 0.02
CUT_SETTLE_S = 5.0  # how long requests get to end their streams and turns before parking starts
CACHE_CHECK_S = 2.0  # after a park failed UNAVAILABLE: how long the cache gets to answer its health check


def cut_message(timeout_s: float) -> str:
    return (
        f"draining: the planner is shutting down and this request was cut after the drain timeout of "
        f"{timeout_s:g} s; a conversation keeps what was committed before the cut"
    )


@dataclass(slots=True)
class DrainReport:
    finished: int = 0  # requests running at the signal that finished within the timeout
    cut: int = 0
    parked: list[str] = field(default_factory=list)
    not_parked: list[str] = field(default_factory=list)  # conversation: why
    seconds: float = 0.0


async def _until(condition, deadline: float) -> bool:
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


async def drain(started: StartedServer[PlannerServicer], timeout_s: float) -> DrainReport:
    """Drains the planner `started` serves; the server keeps listening (to answer 'draining') until the
    caller stops it."""
    began = time.monotonic()
    servicer = started.servicer
    servicer.draining = DRAINING
    await started.set_serving(False)
    report = DrainReport()
    running = len(servicer.running_requests)
    log.info("draining", running=running, drain_timeout_s=timeout_s)
    if not await _until(lambda: not servicer.running_requests, began + timeout_s):
        for req, engine in list(servicer.running_requests.values()):
            servicer.cut[(req.tenant, req.request_id)] = cut_message(timeout_s)
            if engine.abort(req):
                report.cut += 1

    def settled() -> bool:
        # A turn gives its pages back to its conversation when its last step commits, after its stream
        # ended: parking before that would find the conversation busy, with no pages, and skip it.
        busy = any(c.busy for engine in servicer.engines for c in engine.conversations.every())
        return not servicer.running_requests and not busy

    await _until(settled, time.monotonic() + CUT_SETTLE_S)
    report.finished = running - report.cut
    turns = servicer.turns
    unreachable = ""  # why parking stopped: a hung cache costs each park its connect timeout (20 s), not once
    for engine in servicer.engines:
        for conversation in engine.conversations.every():
            name = f"{conversation.tenant}/{conversation.conversation_id}"
            if conversation.busy:  # its turn outlived the settling time: said, never skipped in silence
                report.not_parked.append(f"{name}: its turn did not end within {CUT_SETTLE_S:g} s")
                continue
            if not conversation.pages:
                continue
            if turns.parking.cache_address is None:
                report.not_parked.append(f"{name}: no cache service")
                continue
            if unreachable:
                report.not_parked.append(f"{name}: not tried: {unreachable}")
                continue
            try:
                await turns.park(conversation.tenant, conversation.conversation_id)
                report.parked.append(name)
            except ParkError as error:
                report.not_parked.append(f"{name}: {error.code.name}: {error}")
                if error.code is grpc.StatusCode.UNAVAILABLE and not await turns.parking.cache_answers(
                    CACHE_CHECK_S
                ):
                    unreachable = (
                        f"the cache service did not answer its health check after parking {name} failed"
                    )
    report.seconds = round(time.monotonic() - began, 3)
    log.info(
        "drained",
        seconds=report.seconds,
        finished=report.finished,
        cut=report.cut,
        parked=len(report.parked),
        not_parked=report.not_parked,
    )
    return report
