"""A scheduler with recurrent-state slots over a small pool, and a loop that runs it idle: for the state-slot
tests."""

from __future__ import annotations

import numpy as np

from planner_svc.config import SchedulingConfig
from planner_svc.conversations import Conversation, Conversations
from planner_svc.requests import Request
from planner_svc.retention import RetentionConfig
from planner_svc.scheduler import Scheduler, SchedulerConfig
from protos.layout import RowLayout

PAGE = 4


def state_scheduler(
    state_slots: int, conversations: Conversations | None = None, admission_skips: int | None = None
) -> Scheduler:
    layout = RowLayout.build([2], max_seq_len=64, page_size=PAGE, pool_pages=64)
    settings = SchedulingConfig(prefill_token_budget=64)
    if admission_skips is not None:
        settings = SchedulingConfig(prefill_token_budget=64, admission_skips=admission_skips)
    config = SchedulerConfig(
        page_size=PAGE,
        pool_pages=64,
        buckets=(1, 2),
        max_seq_len=64,
        vocab_size=100,
        state_slots=state_slots,
        settings=settings,
    )
    return Scheduler(config, layout, conversations)


def run_until_idle(scheduler: Scheduler, seq: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """Steps until the scheduler is idle, each answered with token 20 + seq: (the next seq, each step's state
    copies)."""
    copies = []
    while not scheduler.idle:
        step = scheduler.plan(seq)
        assert step is not None
        copies.append(step.state_copies)
        prefill = np.array([20 + seq if c.sample_slot else -1 for c in step.prefill], np.int32)
        scheduler.commit(seq, np.full(len(step.rows), 20 + seq, np.int32), prefill)
        seq += 1
    return seq, copies


def marked_turn(
    state_slots: int, name: str, root: int | None = None, pinned: int | None = None
) -> tuple[Scheduler, Conversation, Request]:
    """A scheduler of `state_slots` state slots and the first turn of conversation `name`, 7 prompt tokens marked
    as a root and/or a pin at those positions, added."""
    conversations = Conversations(PAGE, RetentionConfig())
    scheduler = state_scheduler(state_slots, conversations)
    conversation = conversations.open("tenant", name)
    request = Request(f"{name}0", [5, 6, 7, 8, 9, 10, 11], max_tokens=2)
    request.conversation, request.root, request.pinned = conversation, root, pinned
    conversations.mount(conversation, request.prompt_ids)
    scheduler.add(request)
    return scheduler, conversation, request
