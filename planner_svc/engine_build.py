"""An engine for one executor (or stage group): its scheduler sized from the executor's description, its
conversations, the planner's scheduling settings for the executor's device; and what a start that ended part way
closes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from planner_svc.config import PlannerConfig
from planner_svc.conversations import Conversations
from planner_svc.engine import Engine
from planner_svc.link import ExecutorLink
from planner_svc.parking import Parking
from planner_svc.scheduler import Scheduler, SchedulerConfig
from protos import executor_pb2
from protos.layout import RowLayout

log = structlog.get_logger("deltaserve.planner")


def build_engine(
    description: executor_pb2.ExecutorDescription, link: ExecutorLink, config: PlannerConfig
) -> Engine:
    layout = RowLayout(slots=description.slots, block_span=description.block_span)
    conversations = Conversations(
        description.page_size, config.retention
    )  # the scheduler lends its state pool
    scheduler = Scheduler(
        SchedulerConfig(
            page_size=description.page_size,
            pool_pages=description.pool_pages,
            buckets=tuple(description.buckets),
            max_seq_len=description.max_seq_len,
            vocab_size=description.vocab_size,
            state_slots=description.state_slots,
            settings=config.scheduling.for_device(description.device),  # prefill budget, decode steps
        ),
        layout,
        conversations,
    )
    if scheduler.states.enabled and config.scheduling.prefix_cache:
        log.info(
            f"{description.model_name}: prefix sharing off (a model with recurrent layers: a shared page holds "
            "no recurrent state); conversations resume from checkpoints holding a state copy"
        )
    return Engine(
        scheduler,
        link,
        description,
        inflight_plans=config.inflight_plans,
        executor_timeout=config.executor_timeout,
    )


async def release_attached(
    links: Sequence[ExecutorLink], engines: Sequence[Engine], parking: Parking | None
) -> None:
    """What a planner's start opened before it failed or was cancelled part way: the engines started (their
    tasks and step streams), the channels of the other links (a Describe answered or waiting), the cache's."""
    started = {id(engine.link) for engine in engines}
    closing = [engine.stop() for engine in engines]
    closing += [link.close() for link in links if id(link) not in started]
    if parking is not None:
        closing.append(parking.close())
    for result in await asyncio.gather(*closing, return_exceptions=True):
        if isinstance(result, Exception):  # the rest still closed; the start's own error is what is raised
            log.warning("closing what a planner's start opened failed", error=repr(result))
