"""Draining a planner before it exits (SIGTERM, SIGHUP, Ctrl-C): nothing new is taken, running requests get the
drain timeout to finish and are then cut with UNAVAILABLE, every conversation still holding KV pages is
parked to the cache within the drain timeout again; only then may the server stop (DESIGN §7, invariant 9)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog

from planner_svc.parking import ConversationError

if TYPE_CHECKING:
    from planner_svc.server import PlannerServicer
    from protos.rpc import StartedServer

log = structlog.get_logger("deltaserve.planner.drain")

DRAINING = "draining: the planner is shutting down; retry after its restart or on another planner"
POLL_S = 0.02
CUT_SETTLE_S = 5.0  # how long requests get to end their streams and turns before parking starts
CACHE_CHECK_S = 2.0  # after a park failed UNAVAILABLE: how long the cache gets to answer its health check
# ... and, the cache answering, how long the park's engine gets to say its executor lost (the park and the step
# stream share a connection: its keepalive ends both)
ENGINE_CHECK_S = 1.0
# Parking gets as long as the drain timeout, but never less than this: a short timeout still parks a healthy
# pool's conversations (a park takes milliseconds to a second), and a hung peer costs no more than it.
PARKING_MIN_S = 5.0


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
    await _park_all(servicer, report, max(timeout_s, PARKING_MIN_S))
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


async def _park_all(servicer: PlannerServicer, report: DrainReport, parking_s: float) -> None:
    """Parks every idle conversation holding KV pages within `parking_s` seconds; the others are reported with
    why. A park that fails UNAVAILABLE stops every park where the cache does not answer its health check, and
    that engine's where its executor was found lost: each park on a hung peer would wait out its own bound."""
    deadline = time.monotonic() + parking_s
    turns = servicer.turns
    stopped = ""  # why no park is tried any more
    for engine in servicer.engines:
        executor_lost = ""  # why no more park is tried on this engine
        for conversation in engine.conversations.every():
            name = f"{conversation.tenant}/{conversation.conversation_id}"
            if conversation.busy:  # its turn outlived the settling time: said, never skipped in silence
                report.not_parked.append(f"{name}: its turn did not end within {CUT_SETTLE_S:g} s")
                continue
            if not conversation.pages:
                if conversation.lost:  # with its executor, before the drain or during it
                    report.not_parked.append(f"{name}: {conversation.lost}")
                continue
            if turns.parking.cache_address is None:
                report.not_parked.append(f"{name}: no cache service")
                continue
            if not stopped and time.monotonic() >= deadline:
                stopped = f"the drain's parking time of {parking_s:g} s passed"
            if stopped or executor_lost:
                report.not_parked.append(f"{name}: not tried: {stopped or executor_lost}")
                continue
            try:
                await asyncio.wait_for(
                    turns.park(conversation.tenant, conversation.conversation_id), deadline - time.monotonic()
                )
                report.parked.append(name)
            except TimeoutError:
                report.not_parked.append(
                    f"{name}: not parked within the drain's parking time of {parking_s:g} s"
                )
            except ConversationError as error:
                report.not_parked.append(f"{name}: {error.code.name}: {error}")
                if error.code is not grpc.StatusCode.UNAVAILABLE:
                    continue
                if not await turns.parking.cache_answers(CACHE_CHECK_S):
                    stopped = f"the cache service did not answer its health check after parking {name} failed"
                elif await _until(
                    lambda engine=engine: not engine.serving, time.monotonic() + ENGINE_CHECK_S
                ):
                    executor_lost = f"executor {engine.link.address} was lost: {engine.failure}"
