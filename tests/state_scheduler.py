"""A scheduler with recurrent-state slots over a small pool, and a loop that runs it idle: for the state-slot
tests."""

from __future__ import annotations

import numpy as np

from planner_svc.config import SchedulingConfig
from planner_svc.conversations import Conversations
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
