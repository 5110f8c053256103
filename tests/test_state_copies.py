"""A plan's state copies: checked before anything is written (pairs of state slots in [1, slots), no destination
written twice or read), and applied by the state pool to every recurrent layer."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from executor_svc.plan import PlanError, PlanLimits, check_plan
from executor_svc.state_pool import StatePool
from protos import executor_pb2
from protos.layout import RowLayout
from protos.wire import pack_i32


def _limits(state_slots: int) -> PlanLimits:
    layout = RowLayout.build([2], max_seq_len=64, page_size=4, pool_pages=16)
    return PlanLimits(layout, (1, 2), 100, 64, 4, 16, 64, state_slots=state_slots)


def test_state_copies_are_checked():
    plan = executor_pb2.StepPlan(seq=0, state_copies=pack_i32([[3, 1], [2, 4]]))
    checked = check_plan(plan, _limits(5), 0)
    assert checked.state_copies is not None and checked.state_copies.tolist() == [[3, 1], [2, 4]]
    assert check_plan(executor_pb2.StepPlan(seq=0), _limits(5), 0).state_copies is None
    for copies, limits, message in (
        ([1, 2], _limits(0), "the model has no recurrent layers"),
        ([1, 2, 3], _limits(5), "3 int32 is not a whole number of (source, destination) pairs"),
        ([[0, 2]], _limits(5), "state slot 0 is outside [1, 5) (0 is the sink)"),
        ([[1, 5]], _limits(5), "state slot 5 is outside [1, 5)"),
        ([[1, 2], [3, 2]], _limits(5), "a destination slot is written twice, or is also a source"),
        ([[1, 2], [2, 3]], _limits(5), "a destination slot is written twice, or is also a source"),
    ):
        with pytest.raises(PlanError, match=re.escape(f"state_copies: {message}")):
            check_plan(executor_pb2.StepPlan(seq=0, state_copies=pack_i32(copies)), limits, 0)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_state_pool_copies_every_layer(device: str):
    pool = StatePool(
        2, 4, channels=3, conv_width=4, heads=2, key_dim=2, value_dim=2, dtype=torch.float32, device=device
    )
    pool.conv.normal_()
    pool.recurrent.normal_()
    before_conv, before_recurrent = pool.conv.clone(), pool.recurrent.clone()
    if device == "cuda":  # the copy is queued behind the steps launched before it, never waits for them
        torch.cuda.set_sync_debug_mode("error")
    try:
        pool.copy(np.array([[1, 3]], dtype=np.int32))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(pool.conv[:, 3], before_conv[:, 1]) and torch.equal(
        pool.recurrent[:, 3], before_recurrent[:, 1]
    )
    assert torch.equal(pool.conv[:, :3], before_conv[:, :3])  # the others unchanged
    assert torch.equal(pool.recurrent[:, :3], before_recurrent[:, :3])


def test_a_step_of_prompts_cut_at_their_state_marks_passes_the_checks():
    """A hybrid's planner cuts a prompt where its state is copied (a chat's system prompt: its root mark), one
    chunk per sequence holding a state slot, more than the widest bucket and one: the executor takes them."""
    from planner_svc.config import SchedulingConfig
    from planner_svc.conversations import Conversations
    from planner_svc.planned import SchedulerConfig
    from planner_svc.requests import Request, Sampling
    from planner_svc.retention import RetentionConfig
    from planner_svc.scheduler import Scheduler
    from planner_svc.step_wire import to_proto

    conversations = Conversations(4, RetentionConfig())
    config = SchedulerConfig(
        4, 16, (1, 2), 64, 100, state_slots=5, settings=SchedulingConfig(prefill_token_budget=64)
    )
    scheduler = Scheduler(
        config, RowLayout.build([2], max_seq_len=64, page_size=4, pool_pages=16), conversations
    )
    for i in range(4):
        request = Request(f"r{i}", [5, 6, 7, 8, 9, 10, 11], 2, Sampling())
        request.conversation, request.root = conversations.open("t", f"c{i}"), 3
        conversations.mount(request.conversation, request.prompt_ids)
        scheduler.add(request)
    step = scheduler.plan(0)
    assert step is not None and [(c.start, c.sample_slot) for c in step.prefill] == [(0, 0)] * 4
    plan = to_proto(step)
    assert len(check_plan(plan, _limits(5), 0).prefill) == 4
    plan.prefill.append(plan.prefill[0])  # one more than the sequences that hold a state slot
    with pytest.raises(PlanError, match=re.escape("prefill: 5 chunks, more than a step can hold (4)")):
        check_plan(plan, _limits(5), 0)
