"""The waiting room (waiting_room.py): --max-waiting in choices, and each tenant's share of it."""

from __future__ import annotations

import pytest

from planner_svc.planned import CapacityError
from planner_svc.waiting_room import TenantShare, WaitingRoom


def test_choices_fill_the_room_and_go_back_when_let_go():
    room = WaitingRoom()
    held = room.enter(3, queued=0, max_waiting=4)
    with pytest.raises(
        CapacityError, match=r"full: 3 choices wait .*--max-waiting 4.*no room for this request's 2"
    ):
        room.enter(2, queued=0, max_waiting=4)
    held.let_go()  # one choice queued in a scheduler: counted there now
    room.enter(1, queued=1, max_waiting=4)
    with pytest.raises(CapacityError, match="more choices than the waiting queue holds") as never:
        room.enter(5, queued=0, max_waiting=4)
    assert not never.value.retryable


def test_a_tenant_at_its_share_is_refused_while_others_still_enter():
    room = WaitingRoom()
    alice = room.enter(2, queued=1, max_waiting=10, share=TenantShare("alice", queued=1, limit=3))
    with pytest.raises(
        CapacityError, match=r"tenant 'alice' has its share .*: 3 choices wait .*per-tenant 3"
    ) as full:
        room.enter(1, queued=3, max_waiting=10, share=TenantShare("alice", queued=1, limit=3))
    assert full.value.retryable and room.held == 2
    room.enter(3, queued=3, max_waiting=10, share=TenantShare("bob", queued=0, limit=3))
    alice.close()  # refused or queued: either way no longer held
    room.enter(2, queued=1, max_waiting=10, share=TenantShare("alice", queued=1, limit=3))
    assert room.held == 5


def test_more_choices_than_a_share_never_fit_and_a_zero_share_is_none():
    room = WaitingRoom()
    with pytest.raises(CapacityError, match=r"n is 4: more choices than a tenant may have waiting") as never:
        room.enter(4, queued=0, max_waiting=10, share=TenantShare("alice", queued=0, limit=3))
    assert not never.value.retryable and room.held == 0
    room.enter(9, queued=0, max_waiting=10, share=TenantShare("alice", queued=0, limit=0))
