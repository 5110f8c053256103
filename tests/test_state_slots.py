"""The recurrent-state slot allocator, and the scheduler's use of it: a slot at admission, in the row's
STATE_SLOT column and the prefill chunk, back after the last step's commit; admission waits for one."""

from __future__ import annotations

import numpy as np
import pytest

from planner_svc.config import SchedulingConfig
from planner_svc.requests import Request
from planner_svc.scheduler import Scheduler, SchedulerConfig
from planner_svc.state_slots import StateSlots
from protos.layout import RowLayout


def test_take_and_give_back():
    slots = StateSlots(4)
    assert slots.enabled and slots.total == 3 and slots.free_count == 3
    taken = [slots.take() for _ in range(3)]
    assert taken == [1, 2, 3]  # never the sink slot 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.take()
    slots.give_back(2)
    with pytest.raises(ValueError, match="not taken"):
        slots.give_back(2)
    assert slots.take() == 2
    slots.check()


def test_none_for_a_model_without_recurrent_layers():
    slots = StateSlots(0)
    assert not slots.enabled and slots.total == 0
    with pytest.raises(ValueError, match="sink"):
        StateSlots(1)


def _scheduler(state_slots: int) -> Scheduler:
    layout = RowLayout.build([2], max_seq_len=64, page_size=4, pool_pages=64)
    config = SchedulerConfig(
        page_size=4,
        pool_pages=64,
        buckets=(1, 2),
        max_seq_len=64,
        vocab_size=100,
        state_slots=state_slots,
        settings=SchedulingConfig(prefill_token_budget=64),
    )
    return Scheduler(config, layout)


def test_scheduler_ships_and_returns_state_slots():
    scheduler = _scheduler(state_slots=2)  # one slot for requests
    assert not scheduler.prefix_cache
    first, second = Request("a", [5, 6, 7], max_tokens=2), Request("b", [8, 9], max_tokens=2)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.plan(0)
    assert step is not None and [c.request for c in step.prefill] == [first]  # b waits for a state slot
    assert step.prefill[0].state_slot == first.state_slot == 1
    scheduler.commit(0, np.zeros(0, np.int32), np.array([11], np.int32))
    step = scheduler.plan(1)  # a's decode row, written whole with its state slot
    assert step is not None and step.rows == [first]
    row_slot = scheduler.slots.held_slot(first)
    assert scheduler.mirror.rows[row_slot, RowLayout.STATE_SLOT] == 1
    scheduler.commit(1, np.array([12], np.int32), np.zeros(0, np.int32))  # a's last token
    assert first.state_slot == 0 and scheduler.states.free_count == 1
    step = scheduler.plan(2)
    assert step is not None and step.prefill[0].request is second and step.prefill[0].state_slot == 1
