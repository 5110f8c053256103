"""Reaching a lost executor (or group) again: probe until it answers as it was attached, then reopen."""

from __future__ import annotations

import asyncio

import structlog

from planner_svc.group_link import SHARED_FIELDS, differences
from planner_svc.link import ExecutorLink
from protos import executor_pb2

log = structlog.get_logger("deltaserve.planner.engine")

RECONNECT_BACKOFF_S = (0.1, 1.0)  # first and longest wait between attempts to reach a lost executor
PROBE_TIMEOUT_S = 2.0  # how long one attempt waits for the executor's Describe


async def reconnect(link: ExecutorLink, attached: executor_pb2.ExecutorDescription) -> None:
    """Until the executor answers again as it was attached: the same model and tables (backoff doubling up
    to its cap). One back with another model would stream its token ids under this one's tokenizer. Why one
    that answers is not attached is logged at error level, once a reason (the probes go on every second)."""
    wait, longest = RECONNECT_BACKOFF_S
    said: str | list[str] | None = None  # the reason last logged
    while True:
        await asyncio.sleep(wait)
        wait = min(wait * 2, longest)
        try:
            described = await asyncio.wait_for(link.describe(), PROBE_TIMEOUT_S)
        except ValueError as error:  # a group whose stages answer but cannot serve together (group_link)
            if str(error) != said:
                said = str(error)
                log.error("the executor group is back but cannot serve", executor=link.address, error=said)
            continue
        except Exception as error:  # not back yet
            log.debug("executor not back", executor=link.address, error=type(error).__name__)
            continue
        changed = differences(attached, described, (*SHARED_FIELDS, "pool_pages"))
        if changed:
            if changed != said:
                said = changed
                log.error(
                    "the executor came back as another model or with other tables; restart the planner "
                    "to attach to it",
                    executor=link.address,
                    changed=changed,
                )
            continue
        await link.open()
        log.info("executor back: every row is written whole", executor=link.address)
        return
